"""The inference worker process (for now its trace-driven form).

``run_trace_worker`` replays a recorded routing trace through a live cache manager with the
worker's acquire schedule (``core.acquire_schedule``): one AcquireReq per layer, the previous
layer released in the same message. The routing comes from the trace instead of a model, so
the cache manager, its IO engine and the arena all run for real.
"""

from __future__ import annotations

import logging

from common.cache_client import CacheClient
from common.config import FlashMoEConfig
from common.traces import Trace

from .core import acquire_schedule

log = logging.getLogger("flashmoe.inference_worker")


def run_trace_worker(config: FlashMoEConfig | None, cache_endpoint: str, trace: Trace,
                     start: int = 0, tokens: int | None = None, name: str = "trace-worker"
                     ) -> dict:
    """Replay ``tokens`` decode steps of ``trace`` from row ``start``; returns the cache
    manager's stats at the end."""
    stop = trace.n_tokens if tokens is None else min(trace.n_tokens, start + tokens)
    with CacheClient(cache_endpoint, config, name=name) as client:
        for _token, layer, experts, release in acquire_schedule(trace.experts[start:stop]):
            client.acquire(layer, experts, release)
        client.release()
        stats = client.stats()
    log.info("replayed %d tokens of %s", stop - start, trace.name)
    return stats
