"""The inference worker process (for now its trace-driven form).

``run_trace_worker`` replays a recorded routing trace through a live cache manager with the
worker's acquire schedule (``core.acquire_schedule``): one AcquireReq per layer, the previous
layer released in the same message, the step's input token as the prefetcher's context. The
routing comes from the trace instead of a model, so the cache manager, its IO engine and the
arena all run for real. With ``events`` it publishes one AccessEvent per token on that PUB
endpoint (the learning path's input), sequence-numbered.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from common.bus import Publisher
from common.cache_client import CacheClient
from common.config import FlashMoEConfig
from common.protocol import AccessEvent
from common.traces import TokenStream, Trace

from .core import acquire_schedule

log = logging.getLogger("flashmoe.inference_worker")


class EventPublisher:
    """One AccessEvent per token on a PUB socket."""

    def __init__(self, config: FlashMoEConfig, endpoint: str, source: str) -> None:
        self.ctx = zmq.Context()
        self.publisher = Publisher(self.ctx, config, endpoint)
        self.source, self.epoch, self.seq = source, time.time_ns(), 0

    def publish(self, sequence: int, position: int, input_token: str, next_token: str,
                experts: list[list[int]], probs: list[list[float]]) -> None:
        self.publisher.publish(AccessEvent(self.source, self.epoch, self.seq, sequence,
                                           position, input_token, next_token, experts, probs))
        self.seq += 1

    def close(self) -> None:
        self.publisher.close()
        self.ctx.term()


class TraceWorker:
    """Replays a trace's routing through a CacheClient at a model's pace; with ``compute``
    (a ``TraceExperts``) each layer's experts also run on the fetched weights."""

    def __init__(self, client: CacheClient, trace: Trace, publisher: EventPublisher | None,
                 token_ms: float = 0.0, compute=None) -> None:
        self.client, self.trace, self.publisher = client, trace, publisher
        self.stream = TokenStream.of(trace)
        self.pace_ms = token_ms
        self.compute = compute
        self.tokens = 0
        self.token_ms: list[float] = []  # how long each decode step took
        self._token_started = time.monotonic()

    def replay(self, start: int, stop: int) -> None:
        trace, stream, client = self.trace, self.stream, self.client
        last = trace.num_layers - 1
        compute, hidden = self.compute, None
        k = trace.top_k
        for offset, layer, experts, release in acquire_schedule(trace.experts[start:stop]):
            t = start + offset
            if layer == 0:
                client.step = self.publisher.seq if self.publisher is not None else -1
                self._pace()
                if compute is not None:
                    hidden = compute.new_token(stream.input_token[t])
            elif self.pace_ms:  # the layers spread over the step, as a model's compute does
                left = self._token_started + layer * self.pace_ms / 1000 / (last + 1) \
                    - time.monotonic()
                if left > 0:
                    time.sleep(left)
            if compute is None:
                client.acquire(layer, experts, release, stream.input_token[t])
            else:  # the acquire happens inside, with the same release
                weights = trace.probs[t, layer].astype(float).tolist() \
                    if trace.probs is not None else [1.0 / k] * k
                hidden = compute.step(hidden, layer, experts, weights)
            if layer == last:
                self.tokens += 1
                if self.publisher is not None:
                    probs = trace.probs[t].astype(float).tolist() \
                        if trace.probs is not None else []
                    self.publisher.publish(int(stream.sequence[t]), int(stream.position[t]),
                                           stream.input_token[t], stream.next_token[t],
                                           trace.experts[t].tolist(), probs)

    def _pace(self) -> None:
        now = time.monotonic()
        if self.tokens:
            self.token_ms.append((now - self._token_started) * 1e3)
        left = self._token_started + self.pace_ms / 1000 - now
        if left > 0:
            time.sleep(left)
        self._token_started = time.monotonic()

    def finish(self) -> None:
        """The last step's time."""
        if self.tokens > len(self.token_ms):
            self.token_ms.append((time.monotonic() - self._token_started) * 1e3)


def run_trace_worker(config: FlashMoEConfig | None, cache_endpoint: str, trace: Trace,
                     start: int = 0, tokens: int | None = None, name: str = "trace-worker",
                     events: str | None = None, settle_s: float = 0.5,
                     token_ms: float = 0.0, loop: bool = False, compute: bool = False) -> dict:
    """Replay ``tokens`` decode steps of ``trace`` from row ``start`` (``loop``: that slice
    again and again until the process is stopped); returns the cache manager's stats at the
    end. ``events``: publish AccessEvents there (after ``settle_s``, the subscribers' time to
    connect). ``token_ms``: a decode step lasts at least this long, layer l starting no sooner
    than l/L of it (the worker waits, as for a model's compute). ``compute``: run each layer's experts on the fetched
    weights (transformers' eager code), as a model would."""
    stop = trace.n_tokens if tokens is None else min(trace.n_tokens, start + tokens)
    publisher = EventPublisher(config or FlashMoEConfig(), events, f"{name}[{os.getpid()}]") \
        if events else None
    if publisher is not None:
        time.sleep(settle_s)
    try:
        with CacheClient(cache_endpoint, config, name=name) as client:
            experts = None
            if compute:
                from .generate import arena_fetch
                from .trace_compute import TraceExperts

                experts = TraceExperts(client.store.path, arena_fetch(client))
            worker = TraceWorker(client, trace, publisher, token_ms, experts)
            worker.replay(start, stop)
            while loop:
                worker.replay(start, stop)
            worker.finish()
            client.release()
            stats = {**client.stats(), "token_ms": [round(ms, 3) for ms in worker.token_ms]}
    finally:
        if publisher is not None:
            publisher.close()
    log.info("replayed %d tokens of %s", worker.tokens, trace.name)
    return stats
