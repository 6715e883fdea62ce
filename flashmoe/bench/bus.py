"""`flashmoe bus-bench`: how fast the learning path's bus moves, against its targets.

1. Raw events: one process publishes AccessEvents (one token of the gpt-oss-20b trace each:
   24 layers x top-4 = 96 accesses, router probabilities included) as fast as it can; another
   subscribes and counts. Target: at least 1 M accesses/s, nothing lost.
2. The pipeline: the real feature extractor and predictor processes, fed the trace's tokens at
   a fixed rate (``rates`` tokens/s, for ``seconds``); counts what arrives at each stage (from
   their control sockets: events seen, sequence gaps, batches, predictions) and the time the
   stages need to drain. Target: at least 100 tokens/s (5x a fast decode) without loss.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import zmq

from common.bus import Publisher, Subscriber, ipc_endpoint, stats
from common.config import FlashMoEConfig, load_config
from common.protocol import AccessEvent, LearningMessage
from common.traces import TokenStream, Trace
from flashmoe.cli.options import add_config_flags, add_json, add_trace, csv, save, trace_of

TARGET_ACCESSES_PER_S = 1_000_000
TARGET_TOKENS_PER_S = 100


def _events(trace: Trace, count: int) -> list[AccessEvent]:
    stream = TokenStream.of(trace)
    out = []
    for t in range(min(count, trace.n_tokens)):
        probs = trace.probs[t].astype(float).tolist() if trace.probs is not None else []
        out.append(AccessEvent("bus-bench", 1, t, int(stream.sequence[t]),
                               int(stream.position[t]), stream.input_token[t],
                               stream.next_token[t], trace.experts[t].tolist(), probs))
    return out


def _count_subscriber(endpoint: str, expected: int, ready, out) -> None:
    ctx = zmq.Context()
    counters: Counter = Counter()
    sub = Subscriber(ctx, FlashMoEConfig(), [endpoint], LearningMessage, counters, "count")
    ready.set()
    got, first, last = 0, None, None
    deadline = time.monotonic() + 120
    while got < expected and time.monotonic() < deadline:
        if sub.socket.poll(1000):
            batch = sub.drain()
            if batch:
                first = first or time.perf_counter()
                got += len(batch)
                last = time.perf_counter()
    out.put((got, (last - first) if first and last else 0.0, counters["rejected_malformed"]))
    sub.close()
    ctx.term()


def raw_throughput(trace: Trace, count: int = 20_000) -> dict:
    runtime = Path(tempfile.mkdtemp(prefix="flashmoe-busbench-"))
    endpoint = ipc_endpoint(runtime, "raw")
    events = _events(trace, min(count, trace.n_tokens))
    while len(events) < count:
        events += events[:count - len(events)]
    ctx = zmq.Context()
    pub = Publisher(ctx, FlashMoEConfig(), endpoint, hwm=count + 10)
    spawn = mp.get_context("spawn")
    ready, out = spawn.Event(), spawn.Queue()
    proc = spawn.Process(target=_count_subscriber, args=(endpoint, count, ready, out))
    proc.start()
    ready.wait(30)
    time.sleep(0.5)  # the subscription reaches the publisher
    started = time.perf_counter()
    for seq, event in enumerate(events):
        pub.publish(event)
    sent_s = time.perf_counter() - started
    got, receive_s, malformed = out.get(timeout=180)
    proc.join(30)
    pub.close()
    ctx.term()
    shutil.rmtree(runtime, ignore_errors=True)
    accesses = 96 if not events else sum(len(row) for row in events[0].experts)
    seconds = max(sent_s, receive_s)
    return {"events": count, "received": got, "lost": count - got, "malformed": malformed,
            "seconds": round(seconds, 3), "events_per_s": round(got / seconds, 1),
            "accesses_per_s": round(got * accesses / seconds, 1)}


def pipeline_throughput(trace: Trace, store: str, rates: list[float], seconds: float = 10.0,
                        config: FlashMoEConfig | None = None) -> list[dict]:
    from flashmoe.runtime.launch import Launcher

    config = config or load_config(env={}, overrides=[f"store.path={store}"])
    runtime = Path(tempfile.mkdtemp(prefix="flashmoe-busbench-"))
    results = []
    try:
        for rate in rates:
            run_dir = runtime / f"rate{int(rate)}"
            launcher = Launcher(config, run_dir)
            events_endpoint = ipc_endpoint(run_dir, "worker.events")
            try:
                launcher.start("predictor", ["serve-predictor", store, "--features",
                                             launcher.endpoint("feature_extractor"),
                                             "--checkpoint-dir", str(run_dir / "ckpt")])
                fx = launcher.start("feature_extractor", ["serve-features", store, "--events",
                                                          events_endpoint])
                predictor = launcher.children["predictor"]
                count = int(rate * seconds)
                events = _events(trace, count)
                ctx = zmq.Context()
                pub = Publisher(ctx, config, events_endpoint)
                time.sleep(1.0)  # the extractor's subscription
                started = time.perf_counter()
                for i, event in enumerate(events):
                    wait = started + i / rate - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                    pub.publish(event)
                sent_s = time.perf_counter() - started
                drain_started = time.perf_counter()
                expected = sum(1 for e in events if e.next_token)
                while time.perf_counter() - drain_started < 60:
                    if stats(predictor.control_endpoint)["batches"] >= expected:
                        break
                    time.sleep(0.05)
                drain_s = time.perf_counter() - drain_started
                fx_stats, p_stats = stats(fx.control_endpoint), stats(predictor.control_endpoint)
                pub.close()
                ctx.term()
            finally:
                launcher.stop_all()
            results.append({
                "rate_tokens_per_s": rate, "events": len(events), "sent_s": round(sent_s, 2),
                "extractor_events": fx_stats["events"], "extractor_gaps": fx_stats["n_gap"],
                "batches": fx_stats["batches"], "predictor_batches": p_stats["batches"],
                "predictor_gaps": p_stats["n_gap"], "predictions": p_stats["predictions"],
                "drain_s": round(drain_s, 2),
                "kept_up_tokens_per_s": round(p_stats["batches"] / (sent_s + drain_s), 1),
                "lost": len(events) - fx_stats["events"] + fx_stats["batches"]
                - p_stats["batches"],
                "extractor_cpu_ms_per_event": fx_stats["cpu_ms_per_event"],
                "predictor_cpu_ms": {k: v for k, v in p_stats.items()
                                     if k.startswith("cpu_ms_")}})
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    return results


def format_table(report: dict) -> str:
    raw = report["raw"]
    rows = [f"raw AccessEvents: {raw['events_per_s']:.0f} events/s = "
            f"{raw['accesses_per_s'] / 1e6:.2f} M accesses/s (target "
            f"{TARGET_ACCESSES_PER_S / 1e6:.0f} M), {raw['lost']} of {raw['events']} lost",
            f"{'rate tok/s':>10} {'events':>7} {'fx gaps':>7} {'batches':>8} {'pred gaps':>9} "
            f"{'lost':>5} {'drain s':>7} {'kept up tok/s':>13}"]
    for r in report["pipeline"]:
        rows.append(f"{r['rate_tokens_per_s']:>10.0f} {r['events']:>7} {r['extractor_gaps']:>7} "
                    f"{r['predictor_batches']:>8} {r['predictor_gaps']:>9} {r['lost']:>5} "
                    f"{r['drain_s']:>7.2f} {r['kept_up_tokens_per_s']:>13.1f}")
    rows.append(f"(target: {TARGET_TOKENS_PER_S} tokens/s through worker -> extractor -> "
                f"predictor without loss)")
    return "\n".join(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_trace(p)
    p.add_argument("--store", help="a store of the trace's shape (default: a tiny synthetic one)")
    p.add_argument("--events", type=int, default=20_000, help="events of the raw test")
    p.add_argument("--rates", type=csv(float), default=[100.0, 200.0],
                   help="tokens/s fed through extractor and predictor")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each rate's run")
    add_json(p)
    add_config_flags(p)


def run(args: argparse.Namespace) -> int:
    from flashmoe.tools.synth_store import synth_store

    trace = trace_of(args)
    with tempfile.TemporaryDirectory(prefix="flashmoe-busbench-store-") as scratch:
        store = args.store or str(synth_store(Path(scratch) / "store", "gpt-oss-tiny", 1.0,
                                              8192, 3, show_progress=False).path)
        report = {"trace": trace.name, "raw": raw_throughput(trace, args.events),
                  "pipeline": pipeline_throughput(
                      trace, store, args.rates, args.seconds,
                      load_config(profile=args.profile, file=args.config,
                                  overrides=[f"store.path={store}", *args.set]))}
    print(format_table(report))
    save(args, report)
    return 0
