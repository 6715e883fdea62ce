"""`flashmoe acquire-bench`: demand-path overhead of an AcquireReq whose experts are resident.

Starts a real cache-manager process on an ipc socket, warms one layer's experts, then times
``iterations`` round trips (worker encode -> ROUTER -> core -> reply -> worker decode) of an
acquire for ``top_k`` resident experts. For context, in the same run it also times a bare
ZeroMQ DEALER/ROUTER echo between two processes (the transport floor on this host) and the
decision core's ``acquire`` alone, in-process.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import time
from pathlib import Path

import numpy as np
import zmq

from common.cache_client import CacheClient
from common.store import ExpertStore
from flashmoe.launch import ipc_endpoint, private_runtime_dir, start_cache_manager, stop_process
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


def transport_floor_us(iterations: int, runtime: Path) -> np.ndarray:
    endpoint = ipc_endpoint(runtime, "echo")
    proc = mp.get_context("spawn").Process(target=_echo_server, args=(endpoint,), daemon=True)
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    payload = b"x" * 24  # about an encoded AcquireReq

    def echo():
        sock.send(payload)
        if not sock.poll(10_000):
            raise RuntimeError("echo server did not answer")
        sock.recv()

    try:
        echo()
        return _time_loop(iterations, echo)
    finally:
        sock.send(b"stop")
        proc.join(10)
        sock.close()
        ctx.term()


def core_only_us(store: ExpertStore, layer: int, experts: list[int], iterations: int) -> np.ndarray:
    core = CacheManagerCore(set(store.keys()), n_slots=max(4 * len(experts), 16))
    for key, slot in core.acquire(b"w", layer, experts).loads:
        core.finish_load(key, slot, ok=True)
    return _time_loop(iterations, lambda: core.acquire(b"w", layer, experts))


def summary(samples: np.ndarray) -> dict:
    return {"median_us": round(float(np.median(samples)), 1),
            "p99_us": round(float(np.percentile(samples, 99)), 1)}


def acquire_bench(store_path: str, iterations: int = 20000, top_k: int | None = None,
                  engine: str = "auto") -> dict:
    store = ExpertStore.open(store_path)
    layer = store.manifest.moe_layers[0]
    k = top_k or store.manifest.top_k or 2
    experts = [e for (l, e) in store.keys() if l == layer][:k]
    runtime = private_runtime_dir()
    endpoint = ipc_endpoint(runtime, "cache")
    proc = start_cache_manager(store_path, endpoint,
                               [f"io.engine={engine}", f"cache.capacity_experts={max(4 * k, 16)}"])
    try:
        with CacheClient(endpoint, name="acquire-bench") as client:
            client.acquire(layer, experts)  # load once; every timed acquire is all hits
            acquire = _time_loop(iterations, lambda: client.acquire(layer, experts))
            stats = client.stats()
        transport = transport_floor_us(iterations, runtime)
    finally:
        stop_process(proc)
        shutil.rmtree(runtime, ignore_errors=True)
    core = core_only_us(store, layer, experts, iterations)
    return {"store": str(store_path), "layer": layer, "experts_per_acquire": len(experts),
            "iterations": iterations, **summary(acquire),
            "transport_floor": summary(transport), "core_only": summary(core),
            "engine": stats["engine"], "n_hit": stats["n_hit"], "n_miss": stats["n_miss"]}


def format_table(result: dict) -> str:
    rows = [f"{'what':<40} {'median us':>10} {'p99 us':>8}",
            f"{'AcquireReq round trip, all resident':<40} {result['median_us']:>10.1f} "
            f"{result['p99_us']:>8.1f}",
            f"{'bare ZeroMQ echo between two processes':<40} "
            f"{result['transport_floor']['median_us']:>10.1f} "
            f"{result['transport_floor']['p99_us']:>8.1f}",
            f"{'decision core acquire, in-process':<40} {result['core_only']['median_us']:>10.1f} "
            f"{result['core_only']['p99_us']:>8.1f}",
            f"({result['experts_per_acquire']} experts per acquire, {result['iterations']} "
            f"iterations each)"]
    return "\n".join(rows)
