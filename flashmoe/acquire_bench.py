"""`flashmoe acquire-bench`: demand-path overhead of an AcquireReq whose experts are resident.

Starts a real cache-manager process on an ipc socket, warms one layer's experts, then times
``iterations`` round trips (worker encode -> ROUTER -> core -> reply -> worker decode) of an
acquire for ``top_k`` resident experts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from common.cache_client import CacheClient
from common.store import ExpertStore
from flashmoe.launch import ipc_endpoint, private_runtime_dir, start_cache_manager, stop_process


def acquire_bench(store_path: str, iterations: int = 20000, top_k: int | None = None,
                  engine: str = "auto") -> dict:
    store = ExpertStore.open(store_path)
    layer = store.manifest.moe_layers[0]
    k = top_k or store.manifest.top_k or 2
    experts = [e for (l, e) in store.keys() if l == layer][:k]
    endpoint = ipc_endpoint(private_runtime_dir(), "cache")
    proc = start_cache_manager(store_path, endpoint,
                               [f"io.engine={engine}", f"cache.capacity_experts={max(4 * k, 16)}"])
    try:
        with CacheClient(endpoint, name="acquire-bench") as client:
            client.acquire(layer, experts)  # load once; every timed acquire is all hits
            samples = np.empty(iterations)
            for i in range(iterations):
                t0 = time.perf_counter_ns()
                client.acquire(layer, experts)
                samples[i] = (time.perf_counter_ns() - t0) / 1e3
            stats = client.stats()
    finally:
        stop_process(proc)
    return {"store": str(store_path), "layer": layer, "experts_per_acquire": len(experts),
            "iterations": iterations, "median_us": round(float(np.median(samples)), 1),
            "p99_us": round(float(np.percentile(samples, 99)), 1),
            "mean_us": round(float(samples.mean()), 1), "engine": stats["engine"],
            "n_hit": stats["n_hit"], "n_miss": stats["n_miss"]}


def format_table(result: dict) -> str:
    return (f"{'experts/acquire':>15} {'iterations':>10} {'median us':>10} {'p99 us':>8}\n"
            f"{result['experts_per_acquire']:>15} {result['iterations']:>10} "
            f"{result['median_us']:>10.1f} {result['p99_us']:>8.1f}")


def write_json(result: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
