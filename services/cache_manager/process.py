"""The cache manager process: owns the arena and the IO engine, serves workers over ZeroMQ.

One thread, one ROUTER socket (``recv_from_workers``) polled with a short timeout so that a
stop request (SIGTERM/SIGINT only flip ``self.state``) is seen promptly. Every message goes
through the typed decoder; bad ones are answered with ``Rejected``, counted, and the loop goes
on. Misses are loaded through the IO engine and checksum-verified before the slot is handed
out. When the loop dies of an exception, every known worker is sent ``Dead`` first.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import signal
import time
import traceback
from collections import Counter, deque

import numpy as np
import zmq

from common.arena import Arena
from common.config import ConfigError, FlashMoEConfig
from common.protocol import (AcquireError, AcquireRep, AcquireReq, Dead, Decoder, Hello,
                             ProtocolError, Ready, Rejected, Release, Released, StatsRep,
                             StatsReq, WorkerToCache, encode)
from common.store import ChecksumError, ExpertStore

from .core import AcquireFailed, CacheManagerCore
from .io_engine import IOEngineError, open_engine
from .policies import PolicyError

log = logging.getLogger("flashmoe.cache_manager")
POLL_MS = 100
LATENCY_WINDOW = 10_000


class State(enum.Enum):
    RUNNING = "running"
    STOP_REQUESTED = "stop_requested"


def percentile_us(samples, q: float) -> float:
    return float(np.percentile(np.fromiter(samples, float), q)) if samples else 0.0


class CacheManager:
    def __init__(self, config: FlashMoEConfig, endpoint: str) -> None:
        self.config = config
        self.store = ExpertStore.open(config.store.path)
        n_slots = config.cache.capacity_experts
        # The core first: a bad policy or scope fails before any arena or ring exists.
        try:
            self.core = CacheManagerCore(set(self.store.keys()), n_slots, config.cache.policy,
                                         scope=config.cache.scope)
        except (PolicyError, ValueError) as exc:
            raise ConfigError(f"cache.policy = {config.cache.policy!r} / cache.scope = "
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
        self.decoder = Decoder(WorkerToCache, max_bytes=config.ipc.max_message_bytes)
        self.ctx = zmq.Context()
        self.recv_from_workers = self.ctx.socket(zmq.ROUTER)
        self.recv_from_workers.setsockopt(zmq.LINGER, 1000)  # so Dead still goes out
        self.recv_from_workers.setsockopt(zmq.MAXMSGSIZE, 16 * 1024 * 1024)
        self.recv_from_workers.bind(endpoint)
        self.endpoint = endpoint
        self.workers: dict[bytes, str] = {}
        self.counters = Counter(rejected_malformed=0, rejected_wrong_version=0,
                                rejected_oversized=0, rejected_unexpected=0, n_byte_read=0,
                                n_checksum_error=0, n_io_error=0, n_acquire=0)
        self.read_latency_us: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.state = State.RUNNING
        self.handlers = {Hello: self.handle_hello, AcquireReq: self.handle_acquire,
                         Release: self.handle_release, StatsReq: self.handle_stats}

    # --- loop ---------------------------------------------------------------------------

    def request_stop(self, *_args) -> None:
        self.state = State.STOP_REQUESTED

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv_from_workers, zmq.POLLIN)
        try:
            while self.state is State.RUNNING:
                if not poller.poll(POLL_MS):
                    continue
                while self.state is State.RUNNING:
                    try:
                        frames = self.recv_from_workers.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    self.dispatch(frames)
            self.broadcast_dead("cache manager shut down")
        except Exception as exc:
            self.broadcast_dead(f"cache manager crashed: {exc!r}")
            raise
        finally:
            self.close()

    def dispatch(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            self.reject(identity, ProtocolError("malformed", f"{len(frames) - 1} frames, "
                                                             f"expected 1"))
            return
        try:
            message = self.decoder.decode(frames[1])
        except ProtocolError as exc:
            self.reject(identity, exc)
            return
        if not isinstance(message, Hello) and identity not in self.workers:
            self.reject(identity, ProtocolError("unexpected", "send Hello before anything else"))
            return
        self.handlers[type(message)](identity, message)

    def reject(self, identity: bytes, exc: ProtocolError) -> None:
        self.counters[f"rejected_{exc.code}"] += 1
        log.warning("rejected a message from %r: %s", identity, exc)
        self.send(identity, Rejected(exc.code, str(exc)[:4000]))

    def send(self, identity: bytes, message) -> None:
        try:
            self.recv_from_workers.send_multipart([identity, encode(message)], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dropped a reply to %r: its queue is full", identity)

    def broadcast_dead(self, reason: str) -> None:
        for identity in self.workers:
            self.send(identity, Dead(reason[:4000]))

    def close(self) -> None:
        self.recv_from_workers.close()
        self.ctx.term()
        self.engine.close()
        self.arena.close()

    # --- handlers -----------------------------------------------------------------------

    def handle_hello(self, identity: bytes, msg: Hello) -> None:
        self.workers[identity] = f"{msg.worker_name}[{msg.pid}]"
        log.info("worker %s connected", self.workers[identity])
        self.send(identity, Ready(self.arena.name, self.arena.slot_bytes, self.arena.n_slots,
                                  str(self.store.path.resolve()), self.engine.name,
                                  self.config.digest()))

    def handle_acquire(self, identity: bytes, msg: AcquireReq) -> None:
        self.counters["n_acquire"] += 1
        try:
            plan = self.core.acquire(identity, msg.layer, list(msg.experts))
        except AcquireFailed as exc:
            self.send(identity, AcquireError(msg.seq, msg.layer, exc.code, str(exc), exc.experts))
            return
        if plan.loads:
            failure = self.load(plan.loads)
            if failure is not None:
                self.core.release(identity)
                code, message, experts = failure
                self.send(identity, AcquireError(msg.seq, msg.layer, code, message, experts))
                return
        self.send(identity, AcquireRep(msg.seq, msg.layer, plan.slots))

    def load(self, loads) -> tuple[str, str, list[int]] | None:
        """Read and verify every planned load; returns (code, message, experts) on failure."""
        ops = np.concatenate([self.store.read_ops(layer, expert, slot)
                              for (layer, expert), slot in loads])
        try:
            self.engine.read(ops)
        except IOEngineError as exc:
            for key, slot in loads:
                self.core.finish_load(key, slot, ok=False)
            self.counters["n_io_error"] += 1
            return "io_error", str(exc), [expert for (_, expert), _ in loads]
        failures, start = [], 0
        for (layer, expert), slot in loads:
            n_blocks = self.store.expert(layer, expert).n_blocks
            expert_ops = ops[start:start + n_blocks]
            start += n_blocks
            ok = bool((expert_ops["result"] == expert_ops["length"]).all())
            if not ok:
                self.counters["n_io_error"] += 1
                bad = expert_ops[expert_ops["result"] != expert_ops["length"]][0]
                failures.append(("io_error", f"layer {layer} expert {expert}: read returned "
                                             f"{int(bad['result'])} of {int(bad['length'])} "
                                             f"bytes", expert))
            elif self.config.io.verify_checksums:
                try:
                    self.store.verify_expert_bytes(layer, expert, self.arena.slot(slot))
                except ChecksumError as exc:
                    ok = False
                    self.counters["n_checksum_error"] += 1
                    log.error("%s", exc)
                    failures.append(("checksum", str(exc), expert))
            if ok:
                self.counters["n_byte_read"] += int(expert_ops["length"].sum())
                self.read_latency_us.append(
                    (int(expert_ops["t_complete_ns"].max()) - int(expert_ops["t_submit_ns"].min()))
                    / 1000)
            self.core.finish_load((layer, expert), slot, ok)
        if failures:
            code = failures[0][0]
            return code, "; ".join(f[1] for f in failures), [f[2] for f in failures]
        return None

    def handle_release(self, identity: bytes, msg: Release) -> None:
        self.core.release(identity)
        self.send(identity, Released(msg.seq))

    def handle_stats(self, identity: bytes, msg: StatsReq) -> None:
        self.send(identity, StatsRep(msg.seq, self.stats()))

    def stats(self) -> dict:
        lat = self.read_latency_us
        return {**self.counters, **self.core.stats, "engine": self.engine.name,
                "engine_direct": int(self.engine.direct),
                "engine_fallback_reason": self.engine_fallback_reason,
                "policy": self.core.policy_name, "resident": self.core.resident(),
                "n_slots": self.core.n_slots, "workers": len(self.workers),
                "read_p50_us": percentile_us(lat, 50), "read_p99_us": percentile_us(lat, 99)}


def _arm_parent_death_signal() -> None:
    """Ask the kernel to SIGTERM us when the parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_cache_manager_process(config: FlashMoEConfig, endpoint: str) -> None:
    """Process entry: set up, serve until SIGTERM/SIGINT, shut down cleanly."""
    _arm_parent_death_signal()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    try:
        manager = CacheManager(config, endpoint)
    except Exception:
        log.error("cache manager failed to start:\n%s", traceback.format_exc())
        raise
    signal.signal(signal.SIGTERM, manager.request_stop)
    signal.signal(signal.SIGINT, manager.request_stop)
    log.info("serving %s on %s (%d slots of %d bytes, policy %s) pid %d",
             config.store.path, endpoint, manager.arena.n_slots, manager.arena.slot_bytes,
             config.cache.policy, os.getpid())
    started = time.monotonic()
    manager.run()
    log.info("stopped after %.1f s", time.monotonic() - started)
