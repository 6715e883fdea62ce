"""`flashmoe acquire-bench`: demand-path overhead of an AcquireReq whose experts are resident.

Starts a real cache-manager process on an ipc socket, warms one layer's experts, then times
``iterations`` round trips (worker encode -> ROUTER -> core -> reply -> worker decode) of an
acquire for ``top_k`` resident experts. For context, in the same run it also times a bare
ZeroMQ DEALER/ROUTER echo between two processes (the transport floor on this host) and the
decision core's ``acquire`` alone, in-process.

Head-of-line blocking: the same hits are timed again while a second worker process streams
misses (every one of its acquires needs a real read through the IO engine and a checksum)
at a decode worker's pace: one acquire per layer's compute time of the device model
(gpt-oss-20b on a Jetson Orin, ``STREAM_COMPUTE_S``), in which its process sleeps as a
worker waiting on its accelerator would; ``under_misses`` against the alone figures shows
whether one worker's misses stall another's hits.

Every contender (echo, hits alone, hits under misses) runs once per round, interleaved, so
that a drifting machine hits them alike, and each figure is the median over rounds of that
round's median or p99 (the spread over rounds, min..max, is kept beside it): on a shared
2-core machine one preempted burst should move one round, not the result.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path

from common.bus import ipc_endpoint

import numpy as np
import zmq

from common.cache_client import CacheClient
from common.store import ExpertStore
from flashmoe.cli.options import add_json, save
from flashmoe.sim.device_model import DEVICES, MODEL_SHAPES
from flashmoe.runtime.launch import start_cache_manager, stop_process
from services.cache_manager.core import CacheManagerCore


def _echo_server(endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        frames = sock.recv_multipart()
        sock.send_multipart(frames)
        if frames[1] == b"stop":
            break
    sock.close(linger=1000)
    ctx.term()


def _time_loop(iterations: int, step) -> np.ndarray:
    samples = np.empty(iterations)
    for i in range(iterations):
        t0 = time.perf_counter_ns()
        step()
        samples[i] = (time.perf_counter_ns() - t0) / 1e3
    return samples


class _Echo:
    """A bare ZeroMQ DEALER/ROUTER echo with a server process: the transport floor."""

    def __init__(self, runtime: Path) -> None:
        endpoint = ipc_endpoint(runtime, "echo")
        self.proc = mp.get_context("spawn").Process(target=_echo_server, args=(endpoint,),
                                                    daemon=True)
        self.proc.start()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.payload = b"x" * 24  # about an encoded AcquireReq
        self()

    def __call__(self) -> None:
        self.sock.send(self.payload)
        if not self.sock.poll(10_000):
            raise RuntimeError("echo server did not answer")
        self.sock.recv()

    def close(self) -> None:
        self.sock.send(b"stop")
        self.proc.join(10)
        self.sock.close()
        self.ctx.term()


def core_only_us(store: ExpertStore, layer: int, experts: list[int], iterations: int) -> np.ndarray:
    core = CacheManagerCore({key: store.expert(*key).nbytes for key in store.keys()},
                            n_slots=max(4 * len(experts), 16))
    for load in core.acquire(b"w", layer, experts)[1]:
        core.finish_load(load.key, ok=True)
    return _time_loop(iterations, lambda: core.acquire(b"w", layer, experts))


STREAM_COMPUTE_S = (DEVICES["orin-980pro"].compute_ms_per_layer(MODEL_SHAPES["gpt-oss-20b"])
                    / 1e3)


def _miss_streamer(endpoint: str, groups: list[tuple[int, list[int]]], go, stop, counts) -> None:
    """A second worker: cycles through expert groups that never fit in the cache, so every
    acquire misses, one acquire per layer's compute time, while ``go`` is set."""
    with CacheClient(endpoint, name="miss-streamer") as client:
        i = 0
        while not stop.is_set():
            if not go.wait(0.05):
                continue
            layer, experts = groups[i % len(groups)]
            client.acquire(layer, experts, release_layers=[groups[(i - 1) % len(groups)][0]])
            i += 1
            counts.value = i
            time.sleep(STREAM_COMPUTE_S)


def miss_groups(store: ExpertStore, hot: set[tuple[int, int]], k: int) -> list:
    """Groups of k experts of one layer each, from every expert outside ``hot``."""
    groups = []
    for layer in store.manifest.moe_layers:
        cold = [e for (l, e) in store.keys() if l == layer and (l, e) not in hot]
        groups += [(layer, cold[i:i + k]) for i in range(0, len(cold) - k + 1, k)]
    return groups


def summary(rounds: list[np.ndarray]) -> dict:
    """Median over rounds of each round's median and p99, with their spread."""
    med = [float(np.median(r)) for r in rounds]
    p99 = [float(np.percentile(r, 99)) for r in rounds]
    return {"median_us": round(float(np.median(med)), 1),
            "p99_us": round(float(np.median(p99)), 1),
            "median_spread_us": [round(min(med), 1), round(max(med), 1)],
            "p99_spread_us": [round(min(p99), 1), round(max(p99), 1)],
            "round_medians_us": [round(m, 1) for m in med]}


def acquire_bench(store_path: str, iterations: int = 20000, top_k: int | None = None,
                  engine: str = "auto", rounds: int = 5) -> dict:
    store = ExpertStore.open(store_path)
    layer = store.manifest.moe_layers[0]
    k = top_k or store.manifest.top_k or 2
    experts = [e for (l, e) in store.keys() if l == layer][:k]
    groups = miss_groups(store, {(layer, e) for e in experts}, k)
    # The hits stay pinned; the streamer holds two groups; two more slots keep it missing.
    capacity = k + 2 * k + 2
    if len(groups) * k <= capacity:
        raise ValueError(f"{store_path}: too few experts for a stream of misses")
    runtime = Path(tempfile.mkdtemp(prefix="flashmoe-acqbench-"))
    endpoint = ipc_endpoint(runtime, "cache")
    # The demand path alone: no inline prefetcher working between the requests.
    proc = start_cache_manager(store_path, endpoint,
                               [f"io.engine={engine}", f"cache.capacity_experts={capacity}",
                                "prefetch.inline=false", "prefetch.learned=0"])
    ctx = mp.get_context("spawn")
    go, stop, counts = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
    streamer = ctx.Process(target=_miss_streamer, args=(endpoint, groups, go, stop, counts),
                           daemon=True)
    echo, per_round = None, max(1, iterations // rounds)
    try:
        with CacheClient(endpoint, name="acquire-bench") as client:
            client.acquire(layer, experts)  # load once; every timed acquire is all hits
            echo = _Echo(runtime)
            streamer.start()
            hit = lambda: client.acquire(layer, experts)  # noqa: E731
            floor, alone, under = [], [], []
            streamed = 0.0
            for _ in range(rounds):
                floor.append(_time_loop(per_round, echo))
                alone.append(_time_loop(per_round, hit))
                go.set()
                while counts.value == 0:  # the streamer is connected and missing
                    time.sleep(0.01)
                before, started = counts.value, time.perf_counter()
                under.append(_time_loop(per_round, hit))
                streamed += (counts.value - before) / (time.perf_counter() - started)
                go.clear()
            stats = client.stats()
    finally:
        stop.set()
        go.set()
        if echo is not None:
            echo.close()
        if streamer.pid is not None:
            streamer.join(10)
        stop_process(proc)
        shutil.rmtree(runtime, ignore_errors=True)
    core = core_only_us(store, layer, experts, per_round * rounds)
    core_rounds = [core[i * per_round:(i + 1) * per_round] for i in range(rounds)]
    return {"store": str(store_path), "layer": layer, "experts_per_acquire": len(experts),
            "iterations": per_round * rounds, "rounds": rounds, **summary(alone),
            "transport_floor": summary(floor), "core_only": summary(core_rounds),
            "under_misses": {**summary(under),
                             "miss_acquires_per_s": round(streamed / rounds, 1)},
            "engine": stats["engine"], "n_hit": stats["n_hit"], "n_miss": stats["n_miss"],
            "n_byte_read": stats["n_byte_read"]}


def format_table(result: dict) -> str:
    rows = [f"{'what':<40} {'median us':>10} {'p99 us':>8}",
            f"{'AcquireReq round trip, all resident':<40} {result['median_us']:>10.1f} "
            f"{result['p99_us']:>8.1f}",
            f"{'bare ZeroMQ echo between two processes':<40} "
            f"{result['transport_floor']['median_us']:>10.1f} "
            f"{result['transport_floor']['p99_us']:>8.1f}",
            f"{'decision core acquire, in-process':<40} {result['core_only']['median_us']:>10.1f} "
            f"{result['core_only']['p99_us']:>8.1f}",
            f"{'the same hits while a worker streams misses':<40} "
            f"{result['under_misses']['median_us']:>10.1f} "
            f"{result['under_misses']['p99_us']:>8.1f}",
            f"({result['experts_per_acquire']} experts per acquire, {result['iterations']} "
            f"iterations each in {result['rounds']} interleaved rounds, each figure the median "
            f"over rounds; the miss stream ran at "
            f"{result['under_misses']['miss_acquires_per_s']:.0f} acquires/s, every one a miss)"]
    return "\n".join(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store")
    p.add_argument("--iterations", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds (each figure: the median over rounds)")
    p.add_argument("--engine", default="auto")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    result = acquire_bench(args.store, iterations=args.iterations, engine=args.engine,
                           rounds=args.rounds)
    print(format_table(result))
    save(args, result)
    return 0
