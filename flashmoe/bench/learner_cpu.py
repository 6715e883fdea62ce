"""`flashmoe learner-cpu`: the learning path's CPU a token in-process, with the token stream
paced by pauses between tokens, as a live run paces it.

In `flashmoe run` the extractor and the predictor handle one token and then wait for the next
one (60 ms at 16 tokens/s, ~500 ms end to end on this machine's disk), while the worker and
the cache manager run. Their CPU time a token is then well above what the same calls cost in a
tight loop (`flashmoe bench`). This program separates the causes: the same cores, the same
tokens, one process, nothing else running, and only the pause between tokens changed —
``sleep`` (the thread idles, as a live service waits on its socket) or ``spin`` (the thread
stays busy on the CPU in between, touching almost no memory).
"""

from __future__ import annotations

import argparse
import time

from common.config import FlashMoEConfig
from common.traces import TokenStream, Trace
from flashmoe.cli.options import (add_config_flags, add_json, add_trace, add_warmup, config, csv,
                                  save, trace_of)
from flashmoe.sim.learning import Learning


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(trace: Trace, config: FlashMoEConfig, warmup: str | None,
            pauses_ms: list[float], tokens: int = 300, start: int = 5000,
            modes: tuple[str, ...] = ("sleep", "spin")) -> dict:
    """For each pause (and, for pauses > 0, each mode): CPU ms a token by stage over ``tokens``
    tokens of ``trace`` from token ``start``, after 200 tokens to settle."""
    learning = Learning.create(trace.num_layers, trace.num_experts, trace.top_k, config)
    if warmup:
        learning.load(warmup)
    stream = TokenStream.of(trace)
    for t in range(200):
        learning.on_token(stream, trace, t)
    rows = []
    for pause in pauses_ms:
        for mode in (modes if pause > 0 else ("none",)):
            wait = {"sleep": time.sleep, "spin": _spin, "none": lambda s: None}[mode]
            learning.reset_cpu()
            wall = 0.0
            for i in range(tokens):
                wait(pause / 1e3)
                began = time.perf_counter()
                learning.on_token(stream, trace, start + i)
                wall += time.perf_counter() - began
            stages = {"extract": learning.cpu_s["extract"], **learning.learner.cpu_s}
            rows.append({"pause_ms": pause, "pause": mode,
                         "cpu_ms_per_token": round(learning.cpu_ms_per_token(), 3),
                         "wall_ms_per_token": round(1e3 * wall / tokens, 3),
                         "by_stage": {k: round(1e3 * v / tokens, 3) for k, v in stages.items()}})
    return {"trace": trace.name, "tokens": tokens, "model": config.predictor.model,
            "rows": rows}


def format_table(report: dict) -> str:
    head = f"{'pause':>12} {'cpu ms/tok':>10} {'wall ms/tok':>11}  by stage (ms)"
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        label = f"{r['pause_ms']:g} ms {r['pause']}" if r["pause_ms"] else "none"
        stages = "  ".join(f"{k} {v:.2f}" for k, v in r["by_stage"].items() if v)
        lines.append(f"{label:>12} {r['cpu_ms_per_token']:>10.2f} "
                     f"{r['wall_ms_per_token']:>11.2f}  {stages}")
    lines.append(f"{report['tokens']} tokens of {report['trace']} a row, predictor "
                 f"{report['model']}, one process, one thread")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_trace(p)
    add_warmup(p)
    p.add_argument("--pause-ms", type=csv(float), default=[0.0, 5.0, 60.0],
                   help="pauses between tokens to measure (0: a tight loop)")
    p.add_argument("--tokens", type=int, default=300, help="tokens a row")
    add_json(p)
    add_config_flags(p)


def run(args: argparse.Namespace) -> int:
    trace = trace_of(args)
    report = measure(trace, config(args), args.warmup, args.pause_ms, args.tokens)
    print(format_table(report))
    save(args, report)
    return 0
