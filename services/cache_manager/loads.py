"""The cache manager's loads: expert reads submitted to the IO engine, reaped without waiting,
length-checked and checksum-verified before their waiters are answered.

``Loads`` owns the IO engine (``io.engine``, ``auto`` falling back to pread with a reason) and
the ``Verifier``; the loop calls ``start`` for the loads the decision core hands out, ``reap``
while reads are in flight and ``take_verified`` when the verifier's fd fires. A finished load
goes back to the core, whose waiters are passed to ``answer``. An engine that cannot go on
fails every waiting request with a typed error (``io_timeout`` / ``io_error``) and raises
``EngineFailed``: the process exits with ``EXIT_ENGINE_FAILED`` so that a supervisor restarts
it.

A load that fails on its own (a read error such as EIO, a short read, a checksum mismatch) is
read once more (``READ_ATTEMPTS``; counted in ``n_read_retry``): a transient error costs its
waiters a second read, not their request. If that read fails too, the load costs only its
waiters: they get ``io_error`` / ``checksum``, the slot is freed, and a later
acquire of that expert reads it again (a transient error heals; a bad block keeps failing that
expert alone). Each failure is counted (``n_io_error``, ``n_checksum_error``); the log names
the place (layer, expert, store file, offset) once per expert and kind of failure, so a
persistent bad block does not flood it (``bad_experts``: how many were reported).
"""

from __future__ import annotations

import logging
import os
import queue
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from common.arena import Arena
from common.config import FlashMoEConfig
from common.service import ServiceFailed
from common.store import ChecksumError, ExpertStore, block_location

from .core import CacheManagerCore, Load, Waiter
from .io_engine import IOEngineError, IOFaults, open_engine

log = logging.getLogger("flashmoe.cache_manager")
LATENCY_WINDOW = 10_000
EXIT_ENGINE_FAILED = 3
# After a failure whose drain timed out, closing waits this much more for the late reads
# (counted as stale) rather than a second drain_timeout_s: the process is going down.
CLOSE_DRAIN_S = 1.0
# Reads of one load before its waiters get the error: a transient EIO or a torn read heals on
# the second; a bad block fails both (with O_DIRECT the second read goes to the device again).
READ_ATTEMPTS = 2


class EngineFailed(ServiceFailed):
    """The IO engine cannot go on; the process must exit and be restarted."""

    exit_code = EXIT_ENGINE_FAILED
    what = "an IO engine failure"


def percentile_us(samples, q: float) -> float:
    return float(np.percentile(np.fromiter(samples, float), q)) if samples else 0.0


def split_at_units(ops: np.ndarray, unit: int) -> np.ndarray:
    """Reads into a slot of several units, each within one unit: a read that crosses a unit's
    end is cut there (units and block offsets are 4096-aligned, so both halves stay O_DIRECT
    reads); buffer offsets become the unit's and its offset in it."""
    pieces = []
    for op in ops:
        start, length = int(op["buf_offset"]), int(op["length"])
        while length:
            n = min(length, unit - start % unit)
            piece = op.copy()
            piece["buf_index"] = int(op["buf_index"]) + start // unit
            piece["buf_offset"] = start % unit
            piece["file_offset"] = int(op["file_offset"]) + start - int(op["buf_offset"])
            piece["length"] = n
            pieces.append(piece)
            start += n
            length -= n
    return np.array(pieces, dtype=ops.dtype)


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
            layout = self.arena.layout
            pool = layout.pool_of(load.slot)
            self.store.at(pool.precision).verify_expert_bytes(
                *load.key, self.arena.span(load.slot, pool.units * layout.unit_bytes))
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


class Loads:
    """Reads in flight and their verification, between the decision core and the IO engine."""

    def __init__(self, config: FlashMoEConfig, store: ExpertStore, arena: Arena,
                 core: CacheManagerCore, counters: Counter,
                 answer: Callable[[Waiter], None]) -> None:
        self.config, self.store, self.arena, self.core = config, store, arena, core
        self.counters, self.answer = counters, answer
        self.engine, self.engine_fallback_reason = open_engine(
            config.io.engine, arena.mmap, arena.slot_bytes, arena.n_slots, store.stripe_paths,
            config.io.queue_depth, IOFaults.from_env())
        log.info("IO engine: %s (depth %d)%s", self.engine.name, config.io.queue_depth,
                 f"; fallback because {self.engine_fallback_reason}"
                 if self.engine_fallback_reason else "")
        self.engine.on_failing = self.fail_waiters
        # A failed engine ends the process, whose successor makes a fresh arena: its drain
        # need not outwait a stuck disk, one read timeout is enough (the loop waits on it).
        self.engine.drain_timeout_s = min(self.engine.drain_timeout_s,
                                          max(1.0, config.io.read_timeout_s))
        self.verifier = Verifier(store, arena)
        self.max_blocks = max(e.n_blocks for e in store.manifest.experts)
        # engine batch id -> the loads it carries: (load, its first op, end)
        self.reads: dict[int, list[tuple[Load, int, int]]] = {}
        self.read_latency_us: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.reported: set[tuple[int, int, str]] = set()  # (layer, expert, code) logged
        counters["bad_experts"] = 0
        counters["n_read_retry"] = 0

    def report(self, load: Load, code: str, where: str) -> str:
        """Log a failed load once per (expert, code); returns the message for its waiters."""
        layer, expert = load.key
        message = f"layer {layer} expert {expert}: {where}"
        if (layer, expert, code) not in self.reported:
            self.reported.add((layer, expert, code))
            self.counters["bad_experts"] = len(self.reported)
            log.error("%s loading %s (reported once; later failures of it are counted in "
                      "n_%s)", code, message, "checksum_error" if code == "checksum" else code)
        return message

    def busy(self) -> bool:
        """Reads in flight or checksums pending: the loop must watch the engine's fds."""
        return bool(self.reads) or self.verifier.pending > 0

    def free_depth_experts(self) -> int:
        """Expert loads that fit in the IO queue's free depth: reads neither in flight nor
        queued in the engine, rounded up to whole experts (one expert when any is free, so
        the next load is queued before the disk runs dry)."""
        free = self.config.io.queue_depth - self.engine.inflight() - self.engine.queued()
        return 0 if free <= 0 else -(-free // self.max_blocks)

    def start(self, loads: list[Load], together: bool = False) -> None:
        """Submit the reads of ``loads``: one engine batch per load, or with ``together`` one
        batch for all of them (one submission, one completion: a demand request waits for
        all its experts anyway, and a miss costs one system call instead of one per expert).
        Prefetches go one by one, so that each is usable as soon as its own reads are in."""
        generations = self.arena.generations
        for load in loads:  # before the read: a worker still holding the slot can tell
            generations[load.slot] += 1
        for group in ([loads] if together and len(loads) > 1 else [[load] for load in loads]):
            ops, ends = self.read_ops(group)
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

    def read_ops(self, group: list[Load]) -> tuple[np.ndarray, list[int]]:
        """The block reads of ``group``'s loads, each from its slot's precision (a copy's
        stripes come after the native ones in the engine's files), in one array, and where
        each load's reads end in it. A slot of several units takes its blocks unit by unit
        (no block crosses a unit: ``common.arena.plan_layout``)."""
        layout = self.arena.layout
        if len(layout.pools) == 1 and layout.pools[0].precision == "native":
            return self.store.read_ops_batch([(*load.key, load.slot) for load in group])
        parts, ends, end = [], [], 0
        unit = layout.unit_bytes
        for load in group:
            pool = layout.pool_of(load.slot)
            ops = self.store.at(pool.precision).read_ops(*load.key, load.slot)
            if pool.units > 1:
                ops = split_at_units(ops, unit)
            parts.append(ops)
            end += len(ops)
            ends.append(end)
        return np.concatenate(parts), ends

    def reap(self) -> None:
        """Completed reads, and a read older than ``io.read_timeout_s`` fails the engine."""
        for batch, batch_ops in self.engine.reap():
            members = self.reads.pop(batch, None)
            if members is None:
                log.error("the IO engine completed an unknown batch %d; ignored", batch)
                continue
            for load, start, end in members:
                self.loaded(load, batch_ops[start:end])
        self.engine.check_timeout(self.config.io.read_timeout_s)

    def loaded(self, load: Load, ops: np.ndarray) -> None:
        """One load's reads are complete: check their lengths, then its checksum."""
        lengths = ops["length"]
        if not np.array_equal(ops["result"], lengths):
            self.counters["n_io_error"] += 1
            first = ops[ops["result"] != lengths][0]
            result = int(first["result"])
            what = (os.strerror(-result) + f" (errno {-result})" if result < 0
                    else f"{result} of {int(first['length'])} bytes")
            if self.retry(load):
                return
            self.finish(load, False, "io_error", self.report(
                load, "io_error", f"read of {self.store.stripe_paths[int(first['file_index'])]} "
                f"at offset {int(first['file_offset'])}: {what}"))
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

    def take_verified(self) -> None:
        for load, error in self.verifier.results():
            self.verified(load, error)

    def verified(self, load: Load, error: ChecksumError | None) -> None:
        if error is None:
            self.finish(load, True)
        else:
            self.counters["n_checksum_error"] += 1
            if self.retry(load):
                return
            store = self.store.at(self.arena.layout.pool_of(load.slot).precision)
            stripe, offset = block_location(error.block, store.manifest.block_size,
                                            store.manifest.parallelism)
            self.report(load, "checksum", f"checksum mismatch in block {error.block} "
                        f"({store.stripe_paths[stripe]} at offset {offset})")
            self.finish(load, False, "checksum", str(error))

    def retry(self, load: Load) -> bool:
        """Read a failed load again if it has attempts left (its waiters stay parked); False
        when it has none, and the caller fails it."""
        if load.attempts >= READ_ATTEMPTS or self.engine.failed:
            return False
        load.attempts += 1
        self.counters["n_read_retry"] += 1
        self.start([load])
        return True

    def finish(self, load: Load, ok: bool, code: str = "", message: str = "") -> None:
        for waiter in self.core.finish_load(load.key, ok, code, message):
            self.answer(waiter)

    def fail_waiters(self, reason: str) -> None:
        """Every waiting request gets a typed error (``io_timeout`` or ``io_error``) at once:
        the engine calls this as it fails, before it drains the reads in flight, and the
        process exits after it (no slot of those reads is used again)."""
        code = "io_timeout" if "read_timeout" in reason else "io_error"
        for waiter in self.core.fail_all_loads(code, f"IO engine failed: {reason}"):
            self.answer(waiter)

    def engine_failed(self, exc: IOEngineError) -> EngineFailed:
        """Fail every request still waiting with a typed error; the caller raises what this
        returns."""
        log.error("IO engine failed: %s", exc)
        self.fail_waiters(str(exc))
        self.reads.clear()
        return EngineFailed(str(exc))

    def close(self) -> None:
        if self.engine.drain_timed_out:  # the failure waited its drain out: the process ends
            self.engine.drain_timeout_s = min(self.engine.drain_timeout_s, CLOSE_DRAIN_S)
        self.engine.close()  # drains reads still in flight before the arena goes
        self.verifier.close()
