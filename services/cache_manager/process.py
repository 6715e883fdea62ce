"""The cache manager process: owns the arena and the IO engine, serves workers over ZeroMQ.

One thread runs the loop over the workers' ROUTER (``recv_from_workers``), the IO engine's
completion fd and the checksum verifier's fd. Nothing in the loop waits on the disk: a miss
submits its reads and parks the request (the decision core keeps it), other workers' hits are
answered meanwhile, and each completed expert is checksum-verified before its waiters are
answered (``loads.py``). Workers that went away (closed connection, missed heartbeats) are
found by a connection monitor on the loop's tick; their routing ids are remembered
(``DROPPED_KEPT``) so that one that comes back (a frozen process resumed) is told
``pins_lost``. Every request is checked against the model (``check_request``) before it
touches state, and a refusal is answered with its code and counted (``refused_<code>``); a
Hello may carry the model shape the worker expects, and another shape is refused. The arena's
/dev/shm file is checked on the tick (``ARENA_CHECK_S``) and on every health request: gone or
replaced, the process exits with ``EXIT_ARENA_LOST`` for its supervisor to restart it with a
fresh arena. A set-up that fails releases what it made. The control socket (health, stats, tuning
(``tuning.py``), residency, policy choices) is served on a thread of its own under
``self.lock`` (common/service.py).

SIGTERM/SIGINT only flip ``self.state``; the loop does the work. When the loop ends, every
known worker is sent ``Dead``. A failed IO engine (an error it cannot recover from, or a read
older than ``io.read_timeout_s``) fails the waiting requests, sends ``Dead`` and exits with
status ``EXIT_ENGINE_FAILED`` so that a supervisor restarts the process.
"""

from __future__ import annotations

import os
import time
from collections import Counter, OrderedDict

import numpy as np
import zmq

from common.arena import Arena, plan_layout, pool_fractions
from common.bus import (EndpointInUse, Inbox, PeerWatch, SeqGaps, Subscriber, handshake_mismatch,
                        make_socket)
from common.config import ConfigError, FlashMoEConfig, precision_numbers, precision_split
from common.protocol import (AcquireError, AcquireRep, AcquireReq, Dead, HealthRep, HealthReq,
                             Hello, LearningMessage,
                             PoliciesRep, PoliciesReq, Prediction, PrefetchHint, ProtocolError,
                             Ready, Rejected, Release, Released, ResidencyRep, ResidencyReq,
                             StatsRep, StatsReq, WorkerToCache, encode)
from common.service import Service, ServiceFailed, State, run_service_process
from common.store import ExpertStore, StoreError
from common.threads import limit_threads

from .core import AcquireFailed, CacheManagerCore, Waiter
from .io_engine import IOEngineError
from .loads import EXIT_ENGINE_FAILED, Loads, percentile_us
from .policies import PolicyError
from .policies.scored import VARIANTS
from .tuning import Tuning, live_policies

__all__ = ["EXIT_ARENA_LOST", "EXIT_ENGINE_FAILED", "CacheManager", "run_cache_manager_process"]

POLL_MS = 100
PREDICTION_CHECK_S = 0.005  # how often an idle loop looks for a new Prediction and its age
ARENA_CHECK_S = 1.0  # how often the loop checks that the arena's /dev/shm file is still there
# What a worker and the cache manager must agree on (the handshake compares these sections).
HANDSHAKE_SECTIONS = ("store", "cache", "ipc")
# Refusals counted in the stats as refused_<code> (present from the start, at 0).
REFUSALS = ("unknown_layer", "unknown_expert", "duplicate_expert", "too_many_experts",
            "bad_weights", "pins_lost", "shape_mismatch")
DROPPED_KEPT = 4096  # identities of dropped workers remembered (to answer them pins_lost)
EXIT_ARENA_LOST = 4


class ArenaLost(ServiceFailed):
    """The arena's /dev/shm file was removed or replaced: new workers could not attach."""

    exit_code = EXIT_ARENA_LOST
    what = "the loss of the arena"


class Refusal(Exception):
    """A request that does not fit the model; ``code`` is counted as refused_<code>."""

    def __init__(self, code: str, message: str, experts: list[int] = ()) -> None:
        super().__init__(message)
        self.code, self.experts = code, list(experts)


def model_shape(manifest) -> dict[str, int]:
    return {"layers": len(manifest.moe_layers), "experts": manifest.num_experts,
            "top_k": manifest.top_k, "expert_bytes": manifest.max_expert_bytes}


def shape_differs(mine: dict[str, int], theirs: dict[str, int]) -> list[str]:
    """The keys of ``theirs`` (given and non-zero) whose value differs from ``mine``; an
    unknown key counts as differing."""
    return [key for key, value in theirs.items() if value and mine.get(key) != value]


class CacheManager(Service):
    name = "cache_manager"

    def __init__(self, config: FlashMoEConfig, endpoint: str, control_endpoint: str,
                 predictions: list[str] = ()) -> None:
        super().__init__(config, control_endpoint)
        self.arena = self.loads = self.recv_from_workers = self.peers = None
        self.predictions = None
        try:
            self.set_up(config, endpoint, list(predictions))
        except BaseException:
            # Whatever was made goes (a SIGTERM during set-up raises too): no arena, ring or
            # socket outlives a start that failed.
            self.close_sockets()
            self.ctx.destroy(linger=0)  # (closes a socket a half-made part left open)
            self.close_resources()
            raise

    def set_up(self, config: FlashMoEConfig, endpoint: str, predictions: list[str]) -> None:
        self.store = ExpertStore.open(config.store.path)
        layout, fractions = precision_layout(config.cache, self.store)
        # The core first: a bad policy, parameter or scope fails before any arena or ring.
        try:
            self.core = CacheManagerCore(
                {key: self.store.expert(*key).nbytes for key in self.store.keys()},
                layout.n_units, config.cache.policy, config.cache.policy_params,
                scope=config.cache.scope, prefetch_budget=config.prefetch.budget,
                prefetch_window=min(config.prefetch.window, config.prefetch.budget),
                pools=[(p.precision, list(p.slots())) for p in layout.pools],
                pool_bytes={p: c.manifest.max_expert_bytes for p, c in self.store.copies.items()},
                precision=config.cache.precision, fractions=fractions,
                admit=config.cache.precision_admit,
                upgrades_per_token=config.cache.precision_upgrades,
                weight_power=config.cache.precision_weight)
        except (PolicyError, ValueError) as exc:
            raise ConfigError(f"cache.policy = {config.cache.policy!r} / cache.policy_params = "
                              f"{config.cache.policy_params!r} / cache.scope = "
                              f"{config.cache.scope!r} / cache.precision = "
                              f"{config.cache.precision!r}: {exc}") from None
        self.arena = Arena.create(layout.n_units, layout.unit_bytes)
        self.arena.layout = layout
        self.counters.update(rejected_malformed=0, rejected_wrong_version=0,
                             rejected_oversized=0, rejected_unexpected=0,
                             rejected_config_mismatch=0, n_byte_read=0, n_checksum_error=0,
                             n_io_error=0, n_acquire=0, n_prefetch_hint=0, workers_gone=0,
                             requests_cancelled=0,
                             **{f"refused_{code}": 0 for code in REFUSALS})
        self.loads = Loads(config, self.store, self.arena, self.core, self.counters,
                           self.answer)
        self.inbox = Inbox(WorkerToCache, config.ipc.max_message_bytes, self.counters, "workers")
        # ROUTER_HANDOVER: a worker whose connection comes back (after a freeze) with its own
        # routing id is heard at once, and told pins_lost.
        try:
            self.recv_from_workers = make_socket(self.ctx, zmq.ROUTER, config, bind=endpoint,
                                                 options={zmq.ROUTER_HANDOVER: 1})
        except EndpointInUse as exc:
            raise ServiceFailed(f"cannot serve workers: {exc.strerror}") from None
        self.peers = PeerWatch(self.recv_from_workers)
        self.endpoint = endpoint
        self.workers: dict[bytes, str] = {}
        self.dropped: OrderedDict[bytes, str] = OrderedDict()  # dropped workers, newest last
        self.section_digests = config.section_digests()
        manifest = self.store.manifest
        self.shape = model_shape(manifest)
        self.moe_layers = list(manifest.moe_layers)
        self.layer_position = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.num_experts = manifest.num_experts
        self.tuning = Tuning(config, self.core, len(self.moe_layers), manifest.num_experts,
                             manifest.top_k)
        if predictions:
            self.predictions = Subscriber(self.ctx, config, predictions, LearningMessage,
                                          self.counters, "predictions")
        self.prediction_gaps = SeqGaps(Counter())
        self.popularity = np.zeros((len(self.moe_layers), manifest.num_experts), np.float32)
        self.estimate_at: float | None = None  # when the estimate in use arrived
        self.arena_lost: str | None = None  # why the arena is gone, once it is
        self.handlers = {Hello: self.handle_hello, AcquireReq: self.handle_acquire,
                         PrefetchHint: self.handle_prefetch, Release: self.handle_release,
                         StatsReq: self.handle_stats}

    @property
    def engine(self):
        return self.loads.engine

    @property
    def prefetcher(self):
        return self.tuning.prefetcher

    def banner(self) -> str:
        return (f"serving {self.config.store.path} on {self.endpoint}, control "
                f"{self.control_endpoint} ({self.arena.n_slots} slots of "
                f"{self.arena.slot_bytes} bytes, policy {self.config.cache.policy})")

    # --- loop ---------------------------------------------------------------------------

    def serve(self) -> None:
        """Serve until stopped. With no read in flight the loop waits on the workers' socket
        alone (a blocking receive bounded by the tick, what a plain server does); with reads
        in flight it polls that socket with the engine's and the verifier's fds. The control
        socket has its own thread; ``self.lock`` is held while anything changes."""
        sock = self.recv_from_workers
        sock.setsockopt(zmq.RCVTIMEO, POLL_MS)
        loads = self.loads
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(loads.engine.fileno(), zmq.POLLIN)
        verifier_fd = loads.verifier.fileno()
        poller.register(verifier_fd, zmq.POLLIN)
        predictions = self.predictions
        next_tick = next_prediction_check = next_arena_check = time.monotonic()
        while self.state is State.RUNNING:
            if loads.busy():
                events = dict(poller.poll(POLL_MS))
                identity = sock.recv(zmq.NOBLOCK) if sock in events else None
            else:
                events = {}
                try:
                    identity = sock.recv()
                except zmq.Again:
                    identity = None
            with self.lock:
                try:
                    # A prediction that arrived is used before the request is served
                    # (reading the socket's event flags costs less than a poll).
                    if predictions is not None and \
                            predictions.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        self.take_predictions()
                    if identity is not None:
                        self.serve_worker_message(identity)
                    # Reads in flight are reaped on every turn of the loop, not only when
                    # the completion fd fires (a held-back completion signals nothing).
                    if loads.reads:
                        loads.reap()
                        self.prefetch_ahead()  # reads completed: depth may be free
                    if events and verifier_fd in events:
                        loads.take_verified()
                except IOEngineError as exc:
                    self.state = State.FAILED
                    raise loads.engine_failed(exc) from None
                now = time.monotonic()
                if identity is None or now >= next_tick:
                    next_tick = now + POLL_MS / 1000
                    self.check_peers()
                    if now >= next_arena_check or self.arena_lost:
                        next_arena_check = now + ARENA_CHECK_S
                        self.check_arena()
                if self.predictions is not None and now >= next_prediction_check:
                    next_prediction_check = now + PREDICTION_CHECK_S
                    self.take_predictions()

    def check_arena(self) -> None:
        """Raise ArenaLost (the process exits, a supervisor restarts it with a fresh arena)
        once the arena's /dev/shm file is gone or replaced: no new worker could attach."""
        lost = self.arena_lost or self.arena.missing()
        if lost is not None:
            self.arena_lost = lost
            self.state = State.FAILED
            raise ArenaLost(f"{lost}: workers can no longer attach to the arena")

    def handle_health(self, msg: HealthReq) -> HealthRep:
        """Health on the control thread, with the arena's file checked: ``failed`` once it is
        gone (the loop then exits at its next tick)."""
        if self.arena_lost is None:
            self.arena_lost = self.arena.missing()
        state = "failed" if self.arena_lost else self.state.value
        return HealthRep(msg.seq, self.name, os.getpid(), state,
                         round(time.monotonic() - self.started, 3))

    def on_exit(self, error: Exception | None) -> None:
        """The ``Dead`` sentinel to every known worker."""
        if error is None:
            self.broadcast_dead("cache manager shut down")
        elif isinstance(error, ServiceFailed):
            self.broadcast_dead(f"cache manager failed: {error}")
        else:
            self.broadcast_dead(f"cache manager crashed: {error!r}")

    def check_peers(self) -> None:
        """Drop the workers whose connection closed or missed its heartbeats (on the loop's
        tick, and before a new worker is registered: see PeerWatch)."""
        for identity in self.peers.disconnected():
            self.worker_gone(identity)

    def take_predictions(self) -> None:
        """Every few ms: the newest Prediction goes to the policy; one older than
        ``predictor.max_age_ms`` is withdrawn (the policy falls back to LRU)."""
        now = time.monotonic()
        if self.predictions is not None and self.predictions.socket.poll(0):
            newest = None
            for message in self.predictions.drain():
                if isinstance(message, Prediction):
                    self.prediction_gaps.observe(message.source, message.seq, message.epoch)
                    newest = message
                else:
                    self.counters["rejected_unexpected"] += 1
            if newest is not None and self.use_prediction(newest):
                self.estimate_at = now
        max_age = self.config.predictor.max_age_ms / 1000
        if self.estimate_at is not None and now - self.estimate_at > max_age:
            self.core.set_estimate(None)
            self.estimate_at = None
            self.counters["estimate_expired"] += 1
            self.log.warning("no prediction for %.1f s: the policy falls back to LRU", max_age)

    def use_prediction(self, message: Prediction) -> bool:
        L, E = len(self.moe_layers), self.store.manifest.num_experts
        try:
            S = np.frombuffer(message.scores, np.float32).reshape(message.variants, L * E)
            if (message.layers, message.experts_per_layer, message.variants) != (L, E, VARIANTS):
                raise ValueError(f"{message.layers} x {message.experts_per_layer} x "
                                 f"{message.variants}, expected {L} x {E} x {VARIANTS}")
        except ValueError as exc:
            self.counters["rejected_shape"] += 1
            self.log.warning("dropped a prediction of the wrong shape: %s", exc)
            return False
        self.counters["predictions"] += 1
        # Made after the worker's step event_seq: it is for the step after it.
        return self.core.set_estimate(S.astype(np.float64), self.moe_layers,
                                      step=message.event_seq + 1)

    def serve_worker_message(self, identity: bytes) -> None:
        """One message per turn of the loop (its identity frame already received): a poll
        that finds more returns at once, and no turn pays for an empty receive."""
        sock = self.recv_from_workers
        # The body as a frame: a Hello's frame names the connection (PeerWatch).
        body = sock.recv(copy=False)
        extra, more = 0, body.more
        while more:
            more = sock.recv(copy=False).more
            extra += 1
        self.dispatch(identity, body, extra)

    def dispatch(self, identity: bytes, body: zmq.Frame, extra_frames: int = 0) -> None:
        if extra_frames:
            self.counters["rejected_malformed"] += 1
            self.send(identity, Rejected("malformed", f"{extra_frames + 1} frames, expected 1"))
            return
        message = self.inbox.decode(body.buffer)
        if isinstance(message, ProtocolError):
            self.send(identity, Rejected(message.code, str(message)[:4000]))
            return
        if isinstance(message, Hello):
            self.check_peers()
            self.handle_hello(identity, message, body)
        elif identity not in self.workers:
            if identity in self.dropped:
                self.counters["refused_pins_lost"] += 1
                self.send(identity, Rejected(
                    "pins_lost", f"worker {self.dropped[identity]} was dropped (its connection "
                    f"closed or missed heartbeats): its pins are gone; send Hello again"))
            else:
                self.counters["rejected_unexpected"] += 1
                self.send(identity, Rejected("unexpected", "send Hello before anything else"))
        else:
            self.handlers[type(message)](identity, message)

    def send(self, identity: bytes, message) -> None:
        sock = self.recv_from_workers
        try:
            sock.send(identity, zmq.NOBLOCK | zmq.SNDMORE)
            sock.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self.log.warning("dropped a reply to %r: its queue is full", identity)

    def answer(self, waiter: Waiter) -> None:
        identity, seq = waiter.tag
        if identity not in self.workers:
            return
        if waiter.error is None:
            self.send(identity, AcquireRep(seq, waiter.layer, waiter.slots))
        else:
            self.send(identity, AcquireError(seq, waiter.layer, waiter.error.code,
                                             str(waiter.error)[:4000], waiter.error.experts))

    def broadcast_dead(self, reason: str) -> None:
        for identity in self.workers:
            self.send(identity, Dead(reason[:4000]))

    def close_sockets(self) -> None:
        """(Also after a set-up that failed part way: only what was made.)"""
        if self.predictions is not None:
            self.predictions.close()
        if self.peers is not None:
            self.peers.close()
        if self.recv_from_workers is not None:
            self.recv_from_workers.close()

    def close_resources(self) -> None:
        if self.loads is not None:
            self.loads.close()  # drains reads still in flight before the arena goes
        if self.arena is not None:
            self.arena.close()

    # --- worker requests ----------------------------------------------------------------

    def handle_hello(self, identity: bytes, msg: Hello, frame: zmq.Frame) -> None:
        differ = handshake_mismatch(self.section_digests, msg.config_digests,
                                    HANDSHAKE_SECTIONS)
        if differ:
            self.counters["rejected_config_mismatch"] += 1
            self.log.warning("refused worker %s[%d]: config differs in %s", msg.worker_name,
                             msg.pid, ", ".join(differ))
            self.send(identity, Rejected("config_mismatch", ",".join(differ)))
            return
        if shape_differs(self.shape, msg.shape):
            self.counters["refused_shape_mismatch"] += 1
            text = (f"the worker expects a model of shape {dict(msg.shape)}, the store "
                    f"{self.store.path} has {self.shape}")
            self.log.warning("refused worker %s[%d]: %s", msg.worker_name, msg.pid, text)
            self.send(identity, Rejected("shape_mismatch", text[:4000]))
            return
        self.worker_gone(identity)  # a second Hello starts a new session: the old pins go
        self.dropped.pop(identity, None)
        self.workers[identity] = f"{msg.worker_name}[{msg.pid}]"
        self.peers.remember(identity, frame)
        self.log.info("worker %s connected", self.workers[identity])
        self.send(identity, Ready(self.arena.name, self.arena.slot_bytes, self.arena.n_slots,
                                  str(self.store.path.resolve()), self.engine.name,
                                  self.section_digests, self.arena.layout.to_wire()))

    def worker_gone(self, identity: bytes) -> None:
        name = self.workers.pop(identity, None)
        if name is None:
            return
        self.dropped[identity] = name
        if len(self.dropped) > DROPPED_KEPT:
            self.dropped.popitem(last=False)
        cancelled = self.core.drop_worker(identity)
        prefetcher = self.tuning.prefetcher
        if prefetcher is not None:
            prefetcher.worker_gone(identity)
        self.counters["workers_gone"] += 1
        self.counters["requests_cancelled"] += cancelled
        self.log.info("worker %s went away; its pins are dropped", name)

    def check_request(self, layer: int, experts: list[int], release_layers=()) -> int:
        """The position of ``layer`` among the MoE layers, once the request fits the model:
        else a Refusal (before anything changes). One dict look-up and a max() on the hot
        path; the rest only for requests of more than one expert."""
        position = self.layer_position.get(layer)
        if position is None:
            raise Refusal("unknown_layer", f"layer {layer} is not a MoE layer of the store "
                          f"(its MoE layers: {self.moe_layers[:4]}...{self.moe_layers[-1:]})")
        if experts:
            n, E = len(experts), self.num_experts
            if n > E:
                raise Refusal("too_many_experts", f"{n} experts requested, layer {layer} has "
                              f"{E}")
            if max(experts) >= E:
                bad = [e for e in experts if e >= E]
                raise Refusal("unknown_expert", f"layer {layer} has experts 0..{E - 1}, not "
                              f"{bad[:16]}", bad[:16])
            if n > 1 and len(set(experts)) != n:
                raise Refusal("duplicate_expert", f"expert ids repeat in {experts[:32]}")
        for released in release_layers:
            if released not in self.layer_position:
                raise Refusal("unknown_layer", f"release of layer {released}, not a MoE layer "
                              f"of the store")
        return position

    def refused(self, identity: bytes, exc: Refusal, what: str) -> None:
        self.counters[f"refused_{exc.code}"] += 1
        self.log.debug("refused %s from %s: %s", what, self.workers.get(identity), exc)

    def handle_acquire(self, identity: bytes, msg: AcquireReq) -> None:
        self.counters["n_acquire"] += 1
        try:
            position = self.check_request(msg.layer, msg.experts, msg.release_layers)
            if msg.weights and len(msg.weights) != len(msg.experts):
                raise Refusal("bad_weights", f"{len(msg.weights)} router weights for "
                              f"{len(msg.experts)} experts")
        except Refusal as exc:
            self.refused(identity, exc, "an acquire")
            self.send(identity, AcquireError(msg.seq, msg.layer, exc.code, str(exc)[:4000],
                                             exc.experts))
            return
        counts = self.popularity[position]
        for expert in msg.experts:  # (np.add.at costs more than this loop for a few)
            counts[expert] += 1.0
        try:
            # A worker's step numbers the events it publishes, from 0 per worker: with more
            # than one worker they say nothing of each other (nor which events an estimate
            # followed), and the policy goes by the layer order alone.
            step = msg.step if msg.step >= 0 and len(self.workers) == 1 else None
            slots, loads, waiter = self.core.acquire(identity, msg.layer, msg.experts,
                                                     msg.release_layers, tag=(identity, msg.seq),
                                                     step=step, weights=msg.weights)
        except AcquireFailed as exc:
            self.send(identity, AcquireError(msg.seq, msg.layer, exc.code, str(exc), exc.experts))
            return
        if waiter is None:
            self.send(identity, AcquireRep(msg.seq, msg.layer, slots))
        if loads:
            self.loads.start(loads, together=True)
        prefetcher = self.tuning.prefetcher
        if prefetcher is not None:
            cfg = self.config.prefetch
            hint = self.core.inline_may_hint(cfg.learned, cfg.inline_with_learned)
            prefetcher.after_request(self.core, identity, position, msg.experts,
                                     msg.token, self.moe_layers, hint=hint)
        self.prefetch_ahead()

    def handle_prefetch(self, identity: bytes, msg: PrefetchHint) -> None:
        """No reply: a hint that does not fit the model is dropped and counted."""
        self.counters["n_prefetch_hint"] += 1
        try:
            self.check_request(msg.layer, msg.experts)
        except Refusal as exc:
            self.refused(identity, exc, "a prefetch hint")
            return
        self.core.hint(msg.layer, msg.experts)
        self.issue_prefetches()

    def prefetch_ahead(self) -> None:
        """The learned look-ahead prefetch (while the disk has no demand read), then every
        pending hint that the budget and the free queue depth allow."""
        cfg = self.config.prefetch
        self.core.learned_hints(cfg.learned, cfg.learned_margin, cfg.learned_ratio,
                                cfg.learned_skip)
        self.issue_prefetches()

    def issue_prefetches(self) -> None:
        if self.core.pending_hints or self.core.may_upgrade():
            self.loads.start(self.core.issue_prefetches(self.loads.free_depth_experts()))

    def handle_release(self, identity: bytes, msg: Release) -> None:
        unknown = [layer for layer in msg.layers if layer not in self.layer_position]
        if unknown:
            self.refused(identity, Refusal("unknown_layer", ""), "a release")
            self.send(identity, Rejected("unknown_layer", f"release of layer(s) {unknown[:16]}, "
                                         f"not MoE layers of the store; nothing released"))
            return
        self.core.release(identity, msg.layers or None)
        self.send(identity, Released(msg.seq))

    def handle_stats(self, identity: bytes, msg: StatsReq) -> None:
        self.send(identity, StatsRep(msg.seq, self.stats()))

    # --- control requests ---------------------------------------------------------------

    def tune(self, changes: dict, check: bool) -> tuple[list[str], dict[str, str]]:
        return self.tuning.tune(changes, check)

    def control_handlers(self) -> dict:
        return {ResidencyReq: self.handle_residency, PoliciesReq: self.handle_policies,
                HealthReq: self.handle_health}

    def handle_residency(self, msg: ResidencyReq) -> ResidencyRep:
        L, E = len(self.moe_layers), self.store.manifest.num_experts
        resident = np.zeros((L, E), np.uint8)
        for layer, expert in self.core.slot_of:
            resident[self.layer_position[layer], expert] = 1
        return ResidencyRep(msg.seq, self.moe_layers, E, resident.tobytes(),
                            self.popularity.tobytes())

    def handle_policies(self, msg: PoliciesReq) -> PoliciesRep:
        return PoliciesRep(msg.seq, live_policies(), self.core.policy_name)

    def stats(self) -> dict:
        lat = self.loads.read_latency_us
        engine = self.engine
        control = self.control.counters if self.control is not None else {}
        prefetcher = self.tuning.prefetcher
        return {**self.counters, **self.core.stats, **self.core.gauges(),
                **{f"control_{k}": v for k, v in control.items()},
                "engine": engine.name, "engine_direct": int(engine.direct),
                "engine_fallback_reason": self.loads.engine_fallback_reason,
                "engine_fixed_buffers": int(engine.fixed_buffers),
                "engine_fixed_buffers_reason": engine.fixed_buffers_reason,
                "engine_inflight": engine.inflight(), "policy": self.core.policy_name,
                "estimate": ("none" if self.estimate_at is None else "fresh"),
                "estimate_age_ms": (round((time.monotonic() - self.estimate_at) * 1e3, 1)
                                    if self.estimate_at is not None else -1),
                "prediction_gaps": self.prediction_gaps.counters["n_gap"],
                "prefetcher_hints": prefetcher.stats["hints"] if prefetcher else 0,
                **(prefetcher.sizes() if prefetcher else {}),
                "policy_params": self.core.policy_params_json(),
                "workers": len(self.workers), "state": self.state.value, "pid": os.getpid(),
                "read_p50_us": percentile_us(lat, 50), "read_p99_us": percentile_us(lat, 99)}


def run_cache_manager_process(config: FlashMoEConfig, endpoint: str, control_endpoint: str,
                              predictions: list[str] = ()) -> int:
    """Process entry: set up, serve until SIGTERM/SIGINT, shut down cleanly. Returns the
    exit status (``EXIT_ENGINE_FAILED`` when the IO engine failed)."""
    limit_threads(torch_too=False)  # one thread: see common/threads.py
    return run_service_process(
        lambda: CacheManager(config, endpoint, control_endpoint, predictions),
        CacheManager.name)


def precision_layout(cache, store: ExpertStore):
    """(the arena's layout, random's fractions) of the cache section;
    ConfigError for a precision the store has no copy of, or a malformed split."""
    fractions = precision_numbers("cache.precision_fractions", cache.precision_fractions)
    try:
        layout = plan_layout(store, cache.capacity_experts, cache.precision,
                             precision_split(cache))
    except StoreError as exc:
        raise ConfigError(f"cache.precision = {cache.precision}: {exc}") from None
    fractions = pool_fractions(layout, fractions) if len(layout.pools) > 1 else None
    return layout, fractions
