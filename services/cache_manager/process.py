"""The cache manager process: owns the arena and the IO engine, serves workers over ZeroMQ.

One thread runs the loop over the workers' ROUTER (``recv_from_workers``), the IO engine's
completion fd and the checksum verifier's fd. Nothing in the loop waits on the disk: a miss
submits its reads and parks the request (the decision core keeps it), other workers' hits are
answered meanwhile, and each completed expert is checksum-verified (large ones on a helper
thread: zlib releases the GIL) before its waiters are answered. Workers that went away
(closed connection, missed heartbeats) are found by a connection monitor on the loop's tick.
The control socket (health, stats) is served on a thread of its own under ``self.lock``.

SIGTERM/SIGINT only flip ``self.state``; the loop does the work. When the loop ends, every
known worker is sent ``Dead``. A failed IO engine (an error it cannot recover from, or a read
older than ``io.read_timeout_s``) fails the waiting requests, sends ``Dead`` and exits with
status ``EXIT_ENGINE_FAILED`` so that a supervisor restarts the process.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import queue
import signal
import threading
import time
import traceback
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zmq

from common.arena import Arena
from common.bus import (ControlServer, Inbox, PeerWatch, SeqGaps, Subscriber, handshake_mismatch,
                        make_socket)
from common.config import ConfigError, FlashMoEConfig
from common.protocol import (AcquireError, AcquireRep, AcquireReq, Dead, Hello, LearningMessage,
                             Prediction, PrefetchHint, ProtocolError, Ready, Rejected, Release,
                             Released, ResidencyRep, ResidencyReq, StatsRep, StatsReq,
                             WorkerToCache, encode)
from common.service import arm_parent_death_signal, setup_process_logging
from common.store import ChecksumError, ExpertStore
from common.threads import limit_threads

from .core import AcquireFailed, CacheManagerCore, Load, Waiter
from .io_engine import IOEngineError, open_engine
from .policies import PolicyError, needs_future
from .policies.scored import VARIANTS
from .prefetcher import NextLayerPrefetcher, PrefetcherParams

log = logging.getLogger("flashmoe.cache_manager")
POLL_MS = 100
PREDICTION_CHECK_S = 0.005  # how often an idle loop looks for a new Prediction and its age
LATENCY_WINDOW = 10_000
EXIT_ENGINE_FAILED = 3
# What a worker and the cache manager must agree on (the handshake compares these sections).
HANDSHAKE_SECTIONS = ("store", "cache", "ipc")


class State(enum.Enum):
    RUNNING = "running"
    STOP_REQUESTED = "stopping"
    FAILED = "failed"


class EngineFailed(RuntimeError):
    """The IO engine cannot go on; the process must exit and be restarted."""


def percentile_us(samples, q: float) -> float:
    return float(np.percentile(np.fromiter(samples, float), q)) if samples else 0.0


class Verifier:
    """Checksums of completed loads. A large expert is checked on a helper thread (zlib
    releases the GIL), its result coming back through a queue and an eventfd that the poll
    loop watches; a small one is checked inline, where the hand-off would cost more than the
    check (``INLINE_BYTES``: about 70 us of CRC-32)."""

    INLINE_BYTES = 256 * 1024

    def __init__(self, store: ExpertStore, arena: Arena) -> None:
        self.store, self.arena = store, arena
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify")
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.pending = 0  # submitted, results not yet taken

    def fileno(self) -> int:
        return self._fd

    def check(self, load: Load) -> ChecksumError | None:
        try:
            self.store.verify_expert_bytes(*load.key, self.arena.slot(load.slot))
        except ChecksumError as exc:
            return exc
        return None

    def submit(self, load: Load) -> None:
        self.pending += 1
        self._pool.submit(self._verify, load)

    def _verify(self, load: Load) -> None:
        self._done.put((load, self.check(load)))
        os.eventfd_write(self._fd, 1)

    def results(self) -> list[tuple[Load, ChecksumError | None]]:
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                self.pending -= len(out)
                return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        os.close(self._fd)


class CacheManager:
    def __init__(self, config: FlashMoEConfig, endpoint: str, control_endpoint: str,
                 predictions: list[str] = ()) -> None:
        self.config = config
        self.store = ExpertStore.open(config.store.path)
        n_slots = config.cache.capacity_experts
        # The core first: a bad policy, parameter or scope fails before any arena or ring.
        try:
            self.core = CacheManagerCore(
                {key: self.store.expert(*key).nbytes for key in self.store.keys()}, n_slots,
                config.cache.policy, config.cache.policy_params, scope=config.cache.scope,
                prefetch_budget=config.prefetch.budget,
                prefetch_window=min(config.prefetch.window, config.prefetch.budget))
        except (PolicyError, ValueError) as exc:
            raise ConfigError(f"cache.policy = {config.cache.policy!r} / cache.policy_params = "
                              f"{config.cache.policy_params!r} / cache.scope = "
                              f"{config.cache.scope!r}: {exc}") from None
        self.arena = Arena.create(n_slots, self.store.manifest.slot_bytes)
        try:
            self.engine, self.engine_fallback_reason = open_engine(
                config.io.engine, self.arena.mmap, self.arena.slot_bytes, n_slots,
                self.store.stripe_paths, config.io.queue_depth)
        except IOEngineError:
            self.arena.close()
            raise
        log.info("IO engine: %s (depth %d)%s", self.engine.name, config.io.queue_depth,
                 f"; fallback because {self.engine_fallback_reason}"
                 if self.engine_fallback_reason else "")
        self.verifier = Verifier(self.store, self.arena)
        self.max_blocks = max(e.n_blocks for e in self.store.manifest.experts)
        self.counters = Counter(rejected_malformed=0, rejected_wrong_version=0,
                                rejected_oversized=0, rejected_unexpected=0,
                                rejected_config_mismatch=0, n_byte_read=0, n_checksum_error=0,
                                n_io_error=0, n_acquire=0, n_prefetch_hint=0, workers_gone=0,
                                requests_cancelled=0)
        self.inbox = Inbox(WorkerToCache, config.ipc.max_message_bytes, self.counters, "workers")
        self.ctx = zmq.Context()
        self.recv_from_workers = make_socket(self.ctx, zmq.ROUTER, config, bind=endpoint)
        self.peers = PeerWatch(self.recv_from_workers)
        self.lock = threading.Lock()
        self.control = ControlServer(self.ctx, config, control_endpoint, "cache_manager",
                                     stats=self.stats, state=lambda: self.state.value,
                                     lock=self.lock, tune=self.tune,
                                     extra={ResidencyReq: self.handle_residency})
        self.endpoint = endpoint
        self.workers: dict[bytes, str] = {}
        # engine batch id -> the loads it carries: (load, its first op, end)
        self.reads: dict[int, list[tuple[Load, int, int]]] = {}
        self.read_latency_us: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.section_digests = config.section_digests()
        self.state = State.RUNNING
        manifest = self.store.manifest
        self.moe_layers = list(manifest.moe_layers)
        self.layer_position = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.prefetcher = NextLayerPrefetcher(
            len(self.moe_layers), manifest.num_experts, manifest.top_k,
            PrefetcherParams(threshold=config.prefetch.threshold)) \
            if config.prefetch.inline and config.prefetch.budget else None
        self.predictions = Subscriber(self.ctx, config, list(predictions), LearningMessage,
                                      self.counters, "predictions") if predictions else None
        self.prediction_gaps = SeqGaps(Counter())
        self.popularity = np.zeros((len(self.moe_layers), manifest.num_experts), np.float32)
        self.estimate_at: float | None = None  # when the estimate in use arrived
        self.handlers = {Hello: self.handle_hello, AcquireReq: self.handle_acquire,
                         PrefetchHint: self.handle_prefetch, Release: self.handle_release,
                         StatsReq: self.handle_stats}

    # --- loop ---------------------------------------------------------------------------

    def request_stop(self, *_args) -> None:
        if self.state is State.RUNNING:
            self.state = State.STOP_REQUESTED

    def run(self) -> None:
        """Serve until stopped. With no read in flight the loop waits on the workers' socket
        alone (a blocking receive bounded by the tick, what a plain server does); with reads
        in flight it polls that socket with the engine's and the verifier's fds. The control
        socket has its own thread; ``self.lock`` is held while anything changes."""
        sock = self.recv_from_workers
        sock.setsockopt(zmq.RCVTIMEO, POLL_MS)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.engine.fileno(), zmq.POLLIN)
        verifier_fd = self.verifier.fileno()
        poller.register(verifier_fd, zmq.POLLIN)
        read_timeout_s = self.config.io.read_timeout_s
        predictions = self.predictions
        next_tick = next_prediction_check = time.monotonic()
        try:
            while self.state is State.RUNNING:
                if self.reads or self.verifier.pending:
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
                        if self.reads:
                            self.reap()
                            self.engine.check_timeout(read_timeout_s)
                            self.prefetch_ahead()  # reads completed: depth may be free
                        if events and verifier_fd in events:
                            for load, error in self.verifier.results():
                                self.verified(load, error)
                    except IOEngineError as exc:
                        self.engine_failed(exc)
                    now = time.monotonic()
                    if identity is None or now >= next_tick:
                        next_tick = now + POLL_MS / 1000
                        self.check_peers()
                    if self.predictions is not None and now >= next_prediction_check:
                        next_prediction_check = now + PREDICTION_CHECK_S
                        self.take_predictions()
            self.broadcast_dead("cache manager shut down")
        except EngineFailed as exc:
            self.broadcast_dead(f"cache manager failed: {exc}")
            raise
        except Exception as exc:
            self.broadcast_dead(f"cache manager crashed: {exc!r}")
            raise
        finally:
            self.close()

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
            log.warning("no prediction for %.1f s: the policy falls back to LRU", max_age)

    def use_prediction(self, message: Prediction) -> bool:
        L, E = len(self.moe_layers), self.store.manifest.num_experts
        try:
            S = np.frombuffer(message.scores, np.float32).reshape(message.variants, L * E)
            if (message.layers, message.experts_per_layer, message.variants) != (L, E, VARIANTS):
                raise ValueError(f"{message.layers} x {message.experts_per_layer} x "
                                 f"{message.variants}, expected {L} x {E} x {VARIANTS}")
        except ValueError as exc:
            self.counters["rejected_shape"] += 1
            log.warning("dropped a prediction of the wrong shape: %s", exc)
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
            log.warning("dropped a reply to %r: its queue is full", identity)

    def broadcast_dead(self, reason: str) -> None:
        for identity in self.workers:
            self.send(identity, Dead(reason[:4000]))

    def close(self) -> None:
        self.control.close()
        if self.predictions is not None:
            self.predictions.close()
        self.peers.close()
        self.recv_from_workers.close()
        self.ctx.term()
        self.engine.close()  # drains reads still in flight before the arena goes
        self.verifier.close()
        self.arena.close()

    # --- IO -----------------------------------------------------------------------------

    def free_depth_experts(self) -> int:
        """Expert loads that fit in the IO queue's free depth: reads neither in flight nor
        queued in the engine, rounded up to whole experts (one expert when any is free, so
        the next load is queued before the disk runs dry)."""
        free = self.config.io.queue_depth - self.engine.inflight() - self.engine.queued()
        return 0 if free <= 0 else -(-free // self.max_blocks)

    def start_loads(self, loads: list[Load], together: bool = False) -> None:
        """Submit the reads of ``loads``: one engine batch per load, or with ``together`` one
        batch for all of them (one submission, one completion: a demand request waits for
        all its experts anyway, and a miss costs one system call instead of one per expert).
        Prefetches go one by one, so that each is usable as soon as its own reads are in."""
        for group in ([loads] if together and len(loads) > 1 else [[load] for load in loads]):
            ops, ends = self.store.read_ops_batch([(*load.key, load.slot) for load in group])
            try:
                batch = self.engine.submit(ops)
            except IOEngineError as exc:
                if self.engine.failed:
                    raise
                for load in group:
                    self.counters["n_io_error"] += 1
                    self.finish(load, False, "io_error", f"submitting the reads failed: {exc}")
                continue
            self.reads[batch] = [(load, start, end) for load, start, end
                                 in zip(group, [0] + ends[:-1], ends)]

    def reap(self) -> None:
        for batch, batch_ops in self.engine.reap():
            members = self.reads.pop(batch, None)
            if members is None:
                log.error("the IO engine completed an unknown batch %d; ignored", batch)
                continue
            for load, start, end in members:
                self.loaded(load, batch_ops[start:end])

    def loaded(self, load: Load, ops: np.ndarray) -> None:
        """One load's reads are complete: check their lengths, then its checksum."""
        lengths = ops["length"]
        if not np.array_equal(ops["result"], lengths):
            self.counters["n_io_error"] += 1
            first = ops[ops["result"] != lengths][0]
            layer, expert = load.key
            self.finish(load, False, "io_error",
                        f"layer {layer} expert {expert}: read of stripe "
                        f"{int(first['file_index'])} returned {int(first['result'])} of "
                        f"{int(first['length'])} bytes")
            return
        self.counters["n_byte_read"] += int(lengths.sum())
        self.read_latency_us.append(
            (int(ops["t_complete_ns"].max()) - int(ops["t_submit_ns"].min())) / 1000)
        if not self.config.io.verify_checksums:
            self.finish(load, True)
        elif load.nbytes <= Verifier.INLINE_BYTES:
            self.verified(load, self.verifier.check(load))
        else:
            self.verifier.submit(load)

    def verified(self, load: Load, error: ChecksumError | None) -> None:
        if error is None:
            self.finish(load, True)
        else:
            self.counters["n_checksum_error"] += 1
            log.error("%s", error)
            self.finish(load, False, "checksum", str(error))

    def finish(self, load: Load, ok: bool, code: str = "", message: str = "") -> None:
        for waiter in self.core.finish_load(load.key, ok, code, message):
            self.answer(waiter)

    def answer(self, waiter: Waiter) -> None:
        identity, seq = waiter.tag
        if identity not in self.workers:
            return
        if waiter.error is None:
            self.send(identity, AcquireRep(seq, waiter.layer, waiter.slots))
        else:
            self.send(identity, AcquireError(seq, waiter.layer, waiter.error.code,
                                             str(waiter.error)[:4000], waiter.error.experts))

    def engine_failed(self, exc: IOEngineError) -> None:
        """Fail every waiting request with a typed error, then stop with a failure status."""
        self.state = State.FAILED
        code = "io_timeout" if "read_timeout" in str(exc) else "io_error"
        log.error("IO engine failed: %s", exc)
        for waiter in self.core.fail_all_loads(code, f"IO engine failed: {exc}"):
            self.answer(waiter)
        self.reads.clear()
        raise EngineFailed(str(exc))

    # --- handlers -----------------------------------------------------------------------

    def handle_hello(self, identity: bytes, msg: Hello, frame: zmq.Frame) -> None:
        differ = handshake_mismatch(self.section_digests, msg.config_digests,
                                    HANDSHAKE_SECTIONS)
        if differ:
            self.counters["rejected_config_mismatch"] += 1
            log.warning("refused worker %s[%d]: config differs in %s", msg.worker_name, msg.pid,
                        ", ".join(differ))
            self.send(identity, Rejected("config_mismatch", ",".join(differ)))
            return
        self.workers[identity] = f"{msg.worker_name}[{msg.pid}]"
        self.peers.remember(identity, frame)
        log.info("worker %s connected", self.workers[identity])
        self.send(identity, Ready(self.arena.name, self.arena.slot_bytes, self.arena.n_slots,
                                  str(self.store.path.resolve()), self.engine.name,
                                  self.section_digests))

    def worker_gone(self, identity: bytes) -> None:
        name = self.workers.pop(identity, None)
        if name is None:
            return
        cancelled = self.core.drop_worker(identity)
        self.counters["workers_gone"] += 1
        self.counters["requests_cancelled"] += cancelled
        log.info("worker %s went away; its pins are dropped", name)

    def handle_acquire(self, identity: bytes, msg: AcquireReq) -> None:
        self.counters["n_acquire"] += 1
        position = self.layer_position.get(msg.layer)
        if position is not None:
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
                                                     step=step)
        except AcquireFailed as exc:
            self.send(identity, AcquireError(msg.seq, msg.layer, exc.code, str(exc), exc.experts))
            return
        if waiter is None:
            self.send(identity, AcquireRep(msg.seq, msg.layer, slots))
        if loads:
            self.start_loads(loads, together=True)
        if self.prefetcher is not None:
            position = self.layer_position.get(msg.layer)
            if position is not None:
                cfg = self.config.prefetch
                hint = self.core.inline_may_hint(cfg.learned, cfg.inline_with_learned)
                self.prefetcher.after_request(self.core, identity, position, msg.experts,
                                              msg.token, self.moe_layers, hint=hint)
        self.prefetch_ahead()

    def handle_prefetch(self, identity: bytes, msg: PrefetchHint) -> None:
        self.counters["n_prefetch_hint"] += 1
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
        if self.core.pending_hints:
            self.start_loads(self.core.issue_prefetches(self.free_depth_experts()))

    def handle_release(self, identity: bytes, msg: Release) -> None:
        self.core.release(identity, msg.layers or None)
        self.send(identity, Released(msg.seq))

    def handle_stats(self, identity: bytes, msg: StatsReq) -> None:
        self.send(identity, StatsRep(msg.seq, self.stats()))

    def tune(self, changes: dict, check: bool) -> tuple[list[str], dict[str, str]]:
        """Live changes (control thread, under self.lock): the policy and its parameters
        (e.g. the FlashMoE policy's hybrid share), the capacity within the arena, the
        prefetch window, the inline prefetcher and its threshold; predictor.max_age_ms and
        the look-ahead prefetch's settings are read from self.config at each use."""
        applied, refused = [], {}
        for key, value in changes.items():
            if key == "cache.policy":
                if needs_future(value):
                    refused[key] = f"{value} needs the future (simulator only)"
                    continue
                if not check:
                    try:
                        params = changes.get("cache.policy_params",
                                             self.config.cache.policy_params
                                             if value == self.core.policy_name else None)
                        self.core.set_policy(value, params)
                    except PolicyError as exc:
                        refused[key] = str(exc)
                        continue
            elif key == "cache.policy_params":
                name = changes.get("cache.policy", self.core.policy_name)
                try:
                    self.core.check_policy(name, value)
                    if not check:
                        self.core.set_policy(name, value)
                except PolicyError as exc:
                    refused[key] = str(exc)
                    continue
            elif key == "cache.capacity_experts":
                try:
                    self.core.set_capacity(value, check=check)
                except PolicyError as exc:
                    refused[key] = str(exc)
                    continue
            elif key == "prefetch.window":
                if not check:
                    self.core.prefetch_window = min(value, self.core.prefetch_budget)
            elif key == "prefetch.threshold":
                if not check and self.prefetcher is not None:
                    self.prefetcher.params = dataclasses.replace(self.prefetcher.params,
                                                                 threshold=value)
            elif key == "prefetch.inline":
                if value and not self.config.prefetch.budget:
                    refused[key] = "prefetch.budget is 0: no prefetch can run"
                    continue
                if not check:
                    self.prefetcher = self._make_prefetcher(value)
            elif key not in ("predictor.max_age_ms", "prefetch.learned",
                             "prefetch.learned_margin", "prefetch.learned_ratio",
                             "prefetch.learned_skip", "prefetch.inline_with_learned"):
                continue
            applied.append(key)
        return applied, refused

    def _make_prefetcher(self, on: bool):
        manifest = self.store.manifest
        threshold = self.config.prefetch.threshold
        return NextLayerPrefetcher(len(self.moe_layers), manifest.num_experts, manifest.top_k,
                                   PrefetcherParams(threshold=threshold)) if on else None

    def handle_residency(self, msg: ResidencyReq) -> ResidencyRep:
        L, E = len(self.moe_layers), self.store.manifest.num_experts
        resident = np.zeros((L, E), np.uint8)
        for layer, expert in self.core.slot_of:
            resident[self.layer_position[layer], expert] = 1
        return ResidencyRep(msg.seq, self.moe_layers, E, resident.tobytes(),
                            self.popularity.tobytes())

    def stats(self) -> dict:
        lat = self.read_latency_us
        return {**self.counters, **self.core.stats, **self.core.gauges(),
                **{f"control_{k}": v for k, v in self.control.counters.items()},
                "engine": self.engine.name, "engine_direct": int(self.engine.direct),
                "engine_fallback_reason": self.engine_fallback_reason,
                "engine_inflight": self.engine.inflight(), "policy": self.core.policy_name,
                "estimate": ("none" if self.estimate_at is None else "fresh"),
                "estimate_age_ms": (round((time.monotonic() - self.estimate_at) * 1e3, 1)
                                    if self.estimate_at is not None else -1),
                "prediction_gaps": self.prediction_gaps.counters["n_gap"],
                "prefetcher_hints": self.prefetcher.stats["hints"] if self.prefetcher else 0,
                "policy_params": self.core.policy_params_json(),
                "workers": len(self.workers), "state": self.state.value,
                "read_p50_us": percentile_us(lat, 50), "read_p99_us": percentile_us(lat, 99)}


def run_cache_manager_process(config: FlashMoEConfig, endpoint: str, control_endpoint: str,
                              predictions: list[str] = ()) -> int:
    """Process entry: set up, serve until SIGTERM/SIGINT, shut down cleanly. Returns the
    exit status (``EXIT_ENGINE_FAILED`` when the IO engine failed)."""
    arm_parent_death_signal()
    setup_process_logging()
    limit_threads(torch_too=False)  # one thread: see common/threads.py
    try:
        manager = CacheManager(config, endpoint, control_endpoint, predictions)
    except Exception:
        log.error("cache manager failed to start:\n%s", traceback.format_exc())
        raise
    signal.signal(signal.SIGTERM, manager.request_stop)
    signal.signal(signal.SIGINT, manager.request_stop)
    log.info("serving %s on %s, control %s (%d slots of %d bytes, policy %s) pid %d",
             config.store.path, endpoint, control_endpoint, manager.arena.n_slots,
             manager.arena.slot_bytes, config.cache.policy, os.getpid())
    started = time.monotonic()
    try:
        manager.run()
    except EngineFailed as exc:
        log.error("exiting after an IO engine failure: %s", exc)
        return EXIT_ENGINE_FAILED
    log.info("stopped after %.1f s", time.monotonic() - started)
    return 0
