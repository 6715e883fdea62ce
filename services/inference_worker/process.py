"""The inference worker process, in its trace-driven form (the model-driven form is
``generate.py``).

``run_trace_worker`` replays a recorded routing trace through a live cache manager with the
worker's acquire schedule (``core.acquire_schedule``): one AcquireReq per layer, the previous
layer released in the same message, the step's input token as the prefetcher's context. The
routing comes from the trace instead of a model, so the cache manager, its IO engine and the
arena all run for real. With ``events`` it publishes one AccessEvent per token on that PUB
endpoint (the learning path's input), sequence-numbered (``events.py``).

The worker is a client loop on the service skeleton (common/service.py): SIGTERM/SIGINT end
the replay after the token in progress, and the worker releases its pins and reports as at
the end of its tokens. It has a control socket (health, stats) only when given a control
endpoint.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from common.cache_client import CacheClient
from common.config import FlashMoEConfig
from common.service import Service, State, run_service_process
from common.traces import TokenStream, Trace

from .core import acquire_schedule
from .events import EventPublisher


class TraceWorker:
    """Replays a trace's routing through a CacheClient at a model's pace; with ``compute``
    (a ``TraceExperts``) each layer's experts also run on the fetched weights."""

    def __init__(self, client: CacheClient, trace: Trace, publisher: EventPublisher | None,
                 token_ms: float = 0.0, compute=None,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.client, self.trace, self.publisher = client, trace, publisher
        self.stopping = stopping  # checked before each token: True ends the replay
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
                if self.stopping():
                    return
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


class TraceWorkerService(Service):
    """``run_trace_worker``'s replay as a service: ``serve`` is the client loop."""

    name = "trace_worker"

    def __init__(self, config: FlashMoEConfig | None, cache_endpoint: str, trace: Trace,
                 start: int, stop: int, worker_name: str, events: str | None, settle_s: float,
                 token_ms: float, loop: bool, compute: bool,
                 control_endpoint: str | None = None) -> None:
        super().__init__(config or FlashMoEConfig(), control_endpoint)
        self.client_config = config  # None: the client's defaults, no handshake digests
        self.cache_endpoint, self.trace = cache_endpoint, trace
        self.rows = (start, stop)  # the slice of the trace replayed
        self.worker_name, self.events, self.settle_s = worker_name, events, settle_s
        self.token_ms, self.loop, self.compute = token_ms, loop, compute
        self.worker: TraceWorker | None = None
        self.result: dict = {}  # the cache manager's stats at the end, and each step's time

    def banner(self) -> str:
        return f"{self.worker_name} replaying {self.trace.name} through {self.cache_endpoint}"

    def stopping(self) -> bool:
        return self.state is not State.RUNNING

    def serve(self) -> None:
        publisher = EventPublisher(self.config, self.events,
                                   f"{self.worker_name}[{os.getpid()}]") if self.events else None
        if publisher is not None:
            time.sleep(self.settle_s)
        try:
            with CacheClient(self.cache_endpoint, self.client_config,
                             name=self.worker_name) as client:
                experts = None
                if self.compute:
                    from .generate import arena_fetch
                    from .trace_compute import TraceExperts

                    experts = TraceExperts(client.store.path, arena_fetch(client))
                worker = self.worker = TraceWorker(client, self.trace, publisher, self.token_ms,
                                                   experts, self.stopping)
                worker.replay(*self.rows)
                while self.loop and not self.stopping():
                    worker.replay(*self.rows)
                worker.finish()
                client.release()
                self.result = {**client.stats(),
                               "token_ms": [round(ms, 3) for ms in worker.token_ms]}
        finally:
            if publisher is not None:
                publisher.close()
        self.log.info("replayed %d tokens of %s", worker.tokens, self.trace.name)

    def stats(self) -> dict:
        return {**super().stats(), "tokens": self.worker.tokens if self.worker else 0}


def run_trace_worker(config: FlashMoEConfig | None, cache_endpoint: str, trace: Trace,
                     start: int = 0, tokens: int | None = None, name: str = "trace-worker",
                     events: str | None = None, settle_s: float = 0.5,
                     token_ms: float = 0.0, loop: bool = False, compute: bool = False,
                     control_endpoint: str | None = None) -> dict:
    """Replay ``tokens`` decode steps of ``trace`` from row ``start`` (``loop``: that slice
    again and again until the process is stopped); returns the cache manager's stats at the
    end. ``events``: publish AccessEvents there (after ``settle_s``, the subscribers' time to
    connect). ``token_ms``: a decode step lasts at least this long, layer l starting no sooner
    than l/L of it (the worker waits, as for a model's compute). ``compute``: run each layer's
    experts on the fetched weights (transformers' eager code), as a model would.
    ``control_endpoint``: answer health and stats there."""
    stop = trace.n_tokens if tokens is None else min(trace.n_tokens, start + tokens)
    made: list[TraceWorkerService] = []

    def make() -> TraceWorkerService:
        made.append(TraceWorkerService(config, cache_endpoint, trace, start, stop, name, events,
                                       settle_s, token_ms, loop, compute, control_endpoint))
        return made[0]

    run_service_process(make, TraceWorkerService.name)
    return made[0].result
