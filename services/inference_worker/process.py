"""The inference worker process, in its trace-driven form (the model-driven form is
``generate.py``).

``run_trace_worker`` replays a recorded routing trace through a live cache manager with the
worker's acquire schedule (``core.token_schedule``): one AcquireReq per layer, the previous
layer released in the same message, the step's input token as the prefetcher's context. The
routing comes from the trace instead of a model, so the cache manager, its IO engine and the
arena all run for real. With ``events`` it publishes one AccessEvent per token on that PUB
endpoint (the learning path's input), sequence-numbered (``events.py``). A token whose experts
fail to load is skipped and counted (``tokens_failed``); a cache manager that restarts, or
drops the worker (frozen past the heartbeat timeout), is reconnected to and the token done
again (``TraceWorker``).

The worker is a client loop on the service skeleton (common/service.py): SIGTERM/SIGINT end
the replay after the token in progress, and the worker releases its pins and reports as at
the end of its tokens. It has a control socket (health, stats) only when given a control
endpoint.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable

from common.bus import ConfigMismatch
from common.cache_client import (CacheClient, CacheManagerUnavailable, ExpertLoadError,
                                 PinsLost)
from common.config import FlashMoEConfig
from common.service import Service, ServiceFailed, State, run_service_process
from common.traces import TokenStream, Trace

from .core import model_shape, token_schedule
from .events import EventPublisher

log = logging.getLogger("flashmoe.trace_worker")

TOKEN_MS_KEPT = 10_000  # step times a --loop replay keeps for its summary (the newest)
RECONNECT_TRIES = 5  # tokens in a row done again after a reconnection before exiting
RECONNECT_WAIT_S = 0.5  # between two handshakes of a reconnection
# A reconnection tries handshakes (each within ipc.handshake_timeout_s) for this long: a
# manager that failed drains its reads first, and its supervisor restarts it after a back-off.
RECONNECT_WINDOW_S = 60.0


class TraceWorker:
    """Replays a trace's routing through a CacheClient at a model's pace; with ``compute``
    (a ``TraceExperts``) each layer's experts also run on the fetched weights.

    A token whose experts cannot be loaded (``ExpertLoadError``: a bad checksum, an IO error)
    is skipped: its pins are released, the reason logged once per expert, ``tokens_failed``
    counted, and the replay goes on. A cache manager that went away or dropped this worker
    (``CacheManagerUnavailable``, ``PinsLost`` among them) is reconnected to through
    ``reconnect`` (a new client, a new handshake; up to ``RECONNECT_TRIES`` in a row) and the
    token is done again from its first layer: what was computed of it is discarded, and its
    event is published only once it completed."""

    def __init__(self, client: CacheClient, trace: Trace, publisher: EventPublisher | None,
                 token_ms: float = 0.0, compute=None,
                 stopping: Callable[[], bool] = lambda: False,
                 reconnect: Callable[[], CacheClient] | None = None,
                 step_times_kept: int | None = None) -> None:
        self.client, self.trace, self.publisher = client, trace, publisher
        self.stopping = stopping  # checked before each token: True ends the replay
        self.reconnect = reconnect
        self.stream = TokenStream.of(trace)
        self.pace_ms = token_ms
        self.compute = compute
        self.tokens = 0
        self.tokens_failed = 0
        self.reconnects = 0
        self.failed_experts: set[tuple[int, int]] = set()  # (layer, expert) reported once
        self.precision_weight: dict[str, float] = {}  # precision -> router weight computed
        # how long each decode step took: the newest step_times_kept (a --loop replay runs
        # for hours), else all; _timed counts every step timed
        self.token_ms: collections.deque[float] = collections.deque(maxlen=step_times_kept)
        self._timed = 0
        self._token_started = time.monotonic()

    def replay(self, start: int, stop: int) -> None:
        for t in range(start, stop):
            if self.stopping():
                return
            self.token(t)

    def token(self, t: int) -> None:
        """Decode step ``t``: done, skipped (a failed load) or done again after a
        reconnection; ``CacheManagerUnavailable`` once ``RECONNECT_TRIES`` did not help."""
        for attempt in range(RECONNECT_TRIES + 1):
            try:
                self._layers(t)
            except ExpertLoadError as exc:
                self._skip(t, exc)
                return
            except CacheManagerUnavailable as exc:
                if self.reconnect is None or attempt == RECONNECT_TRIES or self.stopping():
                    raise
                log.warning("token %d: %s; reconnecting and doing the token again", t, exc)
                self._reconnect()
                continue
            self.tokens += 1
            self._publish(t)
            return

    def _layers(self, t: int) -> None:
        trace, stream, client = self.trace, self.stream, self.client
        last = trace.num_layers - 1
        compute, hidden = self.compute, None
        probs = trace.probs[t].astype(float).tolist() if trace.probs is not None else None
        k = trace.top_k
        client.step = self.publisher.seq if self.publisher is not None else -1
        self._pace()
        if compute is not None:
            hidden = compute.new_token(stream.input_token[t])
        for layer, experts, release in token_schedule(trace.experts[t].tolist()):
            if layer and self.pace_ms:  # the layers spread over the step, as a model's does
                left = self._token_started + layer * self.pace_ms / 1000 / (last + 1) \
                    - time.monotonic()
                if left > 0:
                    time.sleep(left)
            if compute is None:
                client.acquire(layer, experts, release, stream.input_token[t],
                               probs[layer] if probs else ())
            else:  # the acquire happens inside, with the same release and weights
                weights = probs[layer] if probs else [1.0 / k] * k
                hidden = compute.step(hidden, layer, experts, weights,
                                      known_weights=probs is not None)
                got = getattr(compute.fetch, "precisions", {}).get(layer, ())
                mix = self.precision_weight
                for precision, weight in zip(got, weights):
                    mix[precision] = mix.get(precision, 0.0) + weight
        if compute is not None and client.lost():  # dropped while it computed: redo it
            raise PinsLost("the cache manager dropped this worker during the token: its "
                           "slots may hold other experts now")

    def _publish(self, t: int) -> None:
        if self.publisher is None:
            return
        trace, stream = self.trace, self.stream
        probs = trace.probs[t].astype(float).tolist() if trace.probs is not None else []
        self.publisher.publish(int(stream.sequence[t]), int(stream.position[t]),
                               stream.input_token[t], stream.next_token[t],
                               trace.experts[t].tolist(), probs)

    def _skip(self, t: int, exc: ExpertLoadError) -> None:
        self.tokens_failed += 1
        new = [e for e in exc.experts if (exc.layer, e) not in self.failed_experts]
        if new:
            self.failed_experts.update((exc.layer, e) for e in new)
            log.warning("token %d skipped: layer %d experts %s cannot be loaded (%s)", t,
                        exc.layer, new, exc)
        try:
            self.client.release()
        except CacheManagerUnavailable:
            if self.reconnect is None:
                raise
            self._reconnect()
        if self.compute is not None:
            self.compute.forget_pins()

    def _reconnect(self) -> None:
        self.client.close()
        self.client = self.reconnect()
        self.reconnects += 1
        if self.compute is not None:
            from .generate import arena_fetch

            self.compute.rebind(arena_fetch(self.client))

    def _pace(self) -> None:
        now = time.monotonic()
        if self.tokens:
            self.token_ms.append((now - self._token_started) * 1e3)
            self._timed += 1
        left = self._token_started + self.pace_ms / 1000 - now
        if left > 0:
            time.sleep(left)
        self._token_started = time.monotonic()

    def finish(self) -> None:
        """The last step's time."""
        if self.tokens > self._timed:
            self.token_ms.append((time.monotonic() - self._token_started) * 1e3)
            self._timed += 1

    def figures(self) -> dict:
        total = sum(self.precision_weight.values())
        # with compute: the router weight of the experts computed at each precision, as shares
        mix = {"precision_mix": {p: round(w / total, 4) for p, w
                                 in sorted(self.precision_weight.items())}} if total else {}
        return {**mix, "tokens": self.tokens, "tokens_failed": self.tokens_failed,
                "reconnects": self.reconnects,
                "failed_experts": sorted([layer, e] for layer, e in self.failed_experts)}


class WorkerRefused(ServiceFailed):
    """The cache manager refused the handshake: restarting cannot help."""

    exit_code = 2
    what = "a refused handshake"


@contextlib.contextmanager
def refused_as_failure():
    try:
        yield
    except ConfigMismatch as exc:  # ShapeMismatch among them
        raise WorkerRefused(str(exc)) from None


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

    def connect(self) -> CacheClient:
        """A client after a handshake that a stop interrupts; a manager that refuses this
        worker (another config, another model's shape) ends it with ``WorkerRefused``."""
        with self.interruptible(), refused_as_failure():
            return CacheClient(self.cache_endpoint, self.client_config, name=self.worker_name,
                               shape=model_shape(self.trace.num_layers, self.trace.num_experts,
                                                 self.trace.top_k))

    def reconnect(self) -> CacheClient:
        """``connect`` again, handshake after handshake for up to ``RECONNECT_WINDOW_S`` (the
        manager may be draining its reads, or restarting after its supervisor's back-off)."""
        deadline = time.monotonic() + RECONNECT_WINDOW_S
        while True:
            try:
                return self.connect()
            except CacheManagerUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise
                self.log.warning("reconnecting to %s: %s; trying again", self.cache_endpoint,
                                 exc)
                with self.interruptible():
                    time.sleep(RECONNECT_WAIT_S)

    def serve(self) -> None:
        publisher = EventPublisher(self.config, self.events,
                                   f"{self.worker_name}[{os.getpid()}]") if self.events else None
        worker = None
        try:
            if publisher is not None:
                with self.interruptible():
                    time.sleep(self.settle_s)
            client = self.connect()
            experts = None
            if self.compute:
                from .generate import arena_fetch
                from .trace_compute import TraceExperts

                experts = TraceExperts(client.store.path, arena_fetch(client))
            worker = self.worker = TraceWorker(
                client, self.trace, publisher, self.token_ms, experts, self.stopping,
                self.reconnect, step_times_kept=TOKEN_MS_KEPT if self.loop else None)
            worker.replay(*self.rows)
            while self.loop and not self.stopping():
                worker.replay(*self.rows)
            worker.finish()
            try:
                worker.client.release()
                cache = worker.client.stats()
            except CacheManagerUnavailable as exc:  # gone at the very end: the worker's own
                self.log.warning("no final stats from the cache manager: %s", exc)
                cache = {}
            self.result = {**cache, **worker.figures(),
                           "token_ms": [round(ms, 3) for ms in worker.token_ms]}
        finally:
            if worker is not None:
                worker.client.close()
            if publisher is not None:
                publisher.close()
        self.log.info("replayed %d tokens of %s (%d skipped, %d reconnections)", worker.tokens,
                      self.trace.name, worker.tokens_failed, worker.reconnects)

    def stats(self) -> dict:
        figures = self.worker.figures() if self.worker else {}
        return {**super().stats(), **figures}


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
    ``control_endpoint``: answer health and stats there. A worker that failed (a refused
    handshake: status 2), or was stopped before it replayed, ends the process with
    ``SystemExit`` and its status."""
    stop = trace.n_tokens if tokens is None else min(trace.n_tokens, start + tokens)
    made: list[TraceWorkerService] = []

    def make() -> TraceWorkerService:
        made.append(TraceWorkerService(config, cache_endpoint, trace, start, stop, name, events,
                                       settle_s, token_ms, loop, compute, control_endpoint))
        return made[0]

    status = run_service_process(make, TraceWorkerService.name)
    if status or not made or not made[0].result:  # failed, or stopped before it replayed
        raise SystemExit(status)
    return made[0].result
