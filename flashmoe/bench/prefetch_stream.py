"""The cache manager's loads under prefetch, as an io-bench contender (`--with-manager`).

A live cache-manager process (the store's engine at the round's queue depth) and a worker
that walks every expert of the store in a random order: before each expert it sends
``PrefetchHint``s for the next ``window`` experts (hints the manager cannot take for want of
free queue depth or prefetch budget are dropped, as designed; the walk repeats them), then
acquires the expert, which waits until it is resident. So the reads are the manager's own
prefetch loads, bounded by its free queue depth, verified and handed out, and the MB/s is
what the live process sustains next to what the bare engine does in the same rounds.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from contextlib import contextmanager
from itertools import groupby
from pathlib import Path

import numpy as np

from common.bus import ipc_endpoint
from common.cache_client import CacheClient
from common.store import ExpertStore
from flashmoe.runtime.launch import start_cache_manager, stop_process

WINDOW = 8


@contextmanager
def manager_prefetch_stream(store_path: str, depth: int, window: int = WINDOW, seed: int = 1,
                            engine: str = "auto"):
    """Yields a callable that runs one pass and returns (MB/s, per-expert wait in us, bytes)."""
    store = ExpertStore.open(store_path)
    keys = store.keys()
    capacity = min(len(keys), max(4 * window, 32))
    runtime = Path(tempfile.mkdtemp(prefix="flashmoe-prefetch-"))
    endpoint = ipc_endpoint(runtime, "cache")
    proc = start_cache_manager(store_path, endpoint, [
        f"io.engine={engine}", f"io.queue_depth={depth}", f"cache.capacity_experts={capacity}",
        f"prefetch.budget={window}", f"prefetch.window={window}"])
    rng = np.random.default_rng(seed)
    try:
        with CacheClient(endpoint, name="prefetch-stream") as client:
            def one_pass():
                order = [keys[k] for k in rng.permutation(len(keys))]
                before = client.stats()["n_byte_read"]
                waits = []
                started = time.perf_counter()
                previous_layer = None
                for i, (layer, expert) in enumerate(order):
                    ahead = order[i + 1:i + 1 + window]
                    for hint_layer, group in groupby(ahead, key=lambda key: key[0]):
                        client.prefetch(hint_layer, [e for _, e in group])
                    t0 = time.perf_counter()
                    client.acquire(layer, [expert], release_layers=[previous_layer]
                                   if previous_layer not in (None, layer) else [])
                    waits.append((time.perf_counter() - t0) * 1e6)
                    previous_layer = layer
                elapsed = time.perf_counter() - started
                nbytes = client.stats()["n_byte_read"] - before
                return nbytes / elapsed / 1e6, waits, nbytes

            yield one_pass
    finally:
        stop_process(proc)
        shutil.rmtree(runtime, ignore_errors=True)
