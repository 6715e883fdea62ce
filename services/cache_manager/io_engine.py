"""IO engines that read store blocks into arena slots, asynchronously.

``UringEngine`` drives the liburing C helper (``csrc/flashmoe_io.c``): arena slots registered
as fixed buffers, stripe files opened O_DIRECT and registered as fixed files, reads issued with
``io_uring_prep_read_fixed``. ``PreadEngine`` is the fallback where the helper is not built,
liburing is missing or io_uring is blocked: ``depth`` threads issuing ``preadv`` into the same
slots. ``open_engine("auto", ...)`` picks the first that works and says why in its reason.

Both have one interface (``IOEngine``): ``submit`` hands over a batch of ``READ_OP_DTYPE``
records and returns at once; ``fileno`` becomes readable when completions are there; ``reap``
(never blocking) returns the batches that completed, each record's ``result`` and timestamps
filled in. At most ``depth`` reads are in flight (``inflight``); the rest of the submitted
reads wait in the engine's queue (``queued``) and go out as earlier ones complete, which
happens inside ``reap``. ``read`` is the synchronous convenience built on the same calls.

Failure: when a submit fails, a read outlives ``check_timeout``'s limit or a ``read`` times
out, the engine first drains every read in flight (bounded by ``drain_timeout_s``), completes
every batch not yet reaped with ``-ECANCELED`` on its unfinished reads, and raises
``IOEngineError`` (``IOTimeoutError`` for timeouts) carrying those batches in ``.batches``.
The engine is failed from then on: every later call raises ``IOEngineError``.

Fault injection (tests, and live processes through ``FMIO_FAULT="kind:param[,kind:param]"``,
read by ``open_engine``): ``delay:MS`` reports completions MS ms after they arrive,
``short_read:N`` makes every N-th read 4096 bytes short, ``submit_error:N`` fails the next
submit after (at most) N of its reads went out, ``stale:N`` forges N completions with bad tags (each must be
counted in ``stats["stale"]`` and written nowhere).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import threading
import time
from collections import deque
from pathlib import Path
from typing import NoReturn, Protocol, Sequence

import numpy as np

from common.cbuild import BuildError, build_library
from common.store import READ_OP_DTYPE

log = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).parent / "csrc"
HELPER_SOURCE = CSRC_DIR / "flashmoe_io.c"
HELPER_LIBRARY = CSRC_DIR / "libflashmoe_io.so"
HELPER_ABI_VERSION = 2

FAULT_ENV = "FMIO_FAULT"
# Fault kind -> the helper's FM_FAULT_* number.
FAULT_KINDS = {"delay": 1, "short_read": 2, "submit_error": 3, "stale": 4}
SHORT_READ_BYTES = 4096  # what a short_read fault takes off a read
DEFAULT_DRAIN_TIMEOUT_S = 10.0
# An idle pread thread takes a queued read at once; only bounds a hang of the fault path.
PICKUP_TIMEOUT_S = 10.0
# read() polls at least this often: completions held by a delay fault raise no signal.
READ_POLL_S = 0.05

IN_PROGRESS = -errno.EINPROGRESS  # result of a read queued or in flight


class IOEngineError(RuntimeError):
    """An IO engine cannot be created, or it failed. ``batches`` are the (id, ops) batches it
    abandoned when it failed: their unfinished reads hold ``-ECANCELED``."""

    def __init__(self, message: str, batches: Sequence[tuple[int, np.ndarray]] = ()) -> None:
        super().__init__(message)
        self.batches = list(batches)


class IOTimeoutError(IOEngineError):
    """A read stayed in flight longer than its timeout."""


class IOEngine(Protocol):
    name: str
    direct: bool  # True when reads bypass the page cache (O_DIRECT)
    depth: int
    drain_timeout_s: float  # how long a failure or close waits for reads in flight
    failed: bool  # True once the engine failed; every later call raises IOEngineError
    stats: dict  # stale completions, faults injected, faults set

    def fileno(self) -> int:
        """An fd that is readable when completions are ready (a zmq.Poller can watch it)."""

    def submit(self, ops: np.ndarray) -> int:
        """Hand over a READ_OP_DTYPE batch; returns its id at once. The engine keeps ``ops``
        and writes into it until the batch is reaped."""

    def reap(self) -> list[tuple[int, np.ndarray]]:
        """The batches that completed since the last call (never blocks); also sends queued
        reads out as in-flight ones complete."""

    def inflight(self) -> int:
        """Reads in flight (never above depth); free queue depth is depth - inflight - queued."""

    def queued(self) -> int:
        """Reads submitted but waiting for a free queue entry."""

    def oldest_inflight_s(self) -> float | None:
        """Age of the oldest read in flight, None when none is."""

    def check_timeout(self, read_timeout_s: float) -> None:
        """Raise IOTimeoutError (and fail the engine) when a read is older than the limit."""

    def read(self, ops: np.ndarray, timeout_s: float = 60.0) -> None:
        """Submit ``ops`` and wait until every read completed (results filled in)."""

    def inject_fault(self, kind: str, param: int) -> None:
        """Test-only: turn a fault on (param > 0) or off (0)."""

    def close(self) -> None:
        """Drain what is in flight (bounded), then release the ring or threads and files."""


def parse_fault_spec(spec: str) -> list[tuple[str, int]]:
    """``"kind:param[,kind:param]"`` -> [(kind, param)]; raises IOEngineError when malformed."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, sep, param = item.partition(":")
        if not sep or kind not in FAULT_KINDS or not param.isdigit():
            raise IOEngineError(f"{FAULT_ENV}: {item!r} is not kind:param with kind one of "
                                f"{', '.join(FAULT_KINDS)} and param an integer >= 0")
        faults.append((kind, int(param)))
    return faults


def build_helper(force: bool = False) -> Path:
    """Compile the C helper with the system compiler and liburing; returns the library path."""
    try:
        return build_library(HELPER_SOURCE, HELPER_LIBRARY, ["-O2"], ["-luring"], force)
    except BuildError as exc:
        raise IOEngineError(f"{exc}\n(is liburing-dev installed?)") from None


def _load_helper() -> ctypes.CDLL:
    if not HELPER_LIBRARY.exists():
        raise IOEngineError(f"io_uring helper not built ({HELPER_LIBRARY} missing; run "
                            f"`flashmoe build-helper`)")
    try:
        lib = ctypes.CDLL(str(HELPER_LIBRARY))
    except OSError as exc:
        raise IOEngineError(f"io_uring helper does not load: {exc}") from None
    if lib.fm_abi_version() != HELPER_ABI_VERSION or lib.fm_op_size() != READ_OP_DTYPE.itemsize:
        raise IOEngineError("io_uring helper is stale (ABI mismatch); run "
                            "`flashmoe build-helper --force`")
    ring, u64 = ctypes.c_void_p, ctypes.c_uint64
    signatures = {
        "fm_probe": ([], ctypes.c_int),
        "fm_max_batches": ([], ctypes.c_int),
        "fm_ring_open": ([ctypes.c_uint, ctypes.c_void_p, u64, ctypes.c_uint,
                          ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int),
        "fm_ring_register_files": ([ring, ctypes.POINTER(ctypes.c_char_p), ctypes.c_uint],
                                   ctypes.c_int),
        "fm_ring_eventfd": ([ring], ctypes.c_int),
        "fm_submit": ([ring, ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(u64)], ctypes.c_int),
        "fm_reap": ([ring, ctypes.POINTER(u64), ctypes.c_uint], ctypes.c_int),
        "fm_inflight": ([ring], ctypes.c_uint),
        "fm_queued": ([ring], ctypes.c_uint),
        "fm_oldest_submit_ns": ([ring], u64),
        "fm_stale_count": ([ring], u64),
        "fm_faults_injected": ([ring], u64),
        "fm_ring_error": ([ring], ctypes.c_int),
        "fm_set_drain_timeout_ns": ([ring, u64], None),
        "fm_set_fault": ([ring, ctypes.c_int, ctypes.c_uint], ctypes.c_int),
        "fm_ring_fail": ([ring, ctypes.c_int], ctypes.c_int),
        "fm_ring_close": ([ring], ctypes.c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def probe_uring() -> None:
    """Raise IOEngineError unless the helper loads and this process may set up a ring."""
    ret = _load_helper().fm_probe()
    if ret < 0:
        raise IOEngineError(f"io_uring_setup is not allowed here: {os.strerror(-ret)} "
                            f"(errno {-ret}; seccomp, kernel.io_uring_disabled or an old kernel)")


def _buffer_address(buffer) -> int:
    """Address of a writable buffer (mmap, bytearray) without copying it."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _check_errno(ret: int, what: str) -> None:
    if ret < 0:
        raise IOEngineError(f"{what}: {os.strerror(-ret)} (errno {-ret})")


def _check_ops(ops: np.ndarray) -> None:
    if ops.dtype != READ_OP_DTYPE or ops.ndim != 1 or not ops.flags.c_contiguous or \
            not ops.flags.writeable:
        raise ValueError("ops must be a writeable, contiguous 1-d READ_OP_DTYPE array")


class _EngineBase:
    """What both engines share: the failed state, ``read`` and ``check_timeout`` on top of
    submit / reap, and batches reaped by ``read`` that belong to the caller's ``reap``.

    An engine adds ``submit``, ``fileno``, ``oldest_inflight_s``, ``_closed``, ``_reap_ready``
    (the completed batches, failing the engine on a ring error) and ``_abandon`` (drain with
    the bound, complete every batch; returns (drained, those batches))."""

    name: str

    def __init__(self, depth: int, drain_timeout_s: float) -> None:
        if depth < 1:
            raise IOEngineError(f"queue depth must be at least 1, got {depth}")
        self.depth = depth
        self.drain_timeout_s = drain_timeout_s
        self._failure: str | None = None
        self._unclaimed: list[tuple[int, np.ndarray]] = []

    @property
    def failed(self) -> bool:
        """True once the engine failed: every later call raises IOEngineError."""
        return self._failure is not None

    def _usable(self) -> None:
        if self._failure is not None:
            raise IOEngineError(f"the {self.name} IO engine failed earlier: {self._failure}")
        if self._closed():
            raise IOEngineError(f"the {self.name} IO engine is closed")

    def _fail(self, error: type[IOEngineError], reason: str) -> NoReturn:
        drained, batches = self._abandon()
        batches = self._unclaimed + batches
        self._unclaimed = []
        if drained:
            reason += "; every read in flight was drained first"
        else:
            reason += (f"; reads were still in flight after the drain timeout "
                       f"({self.drain_timeout_s} s) and may still land in their slots")
        self._failure = reason
        log.error("%s IO engine failed: %s", self.name, reason)
        raise error(reason, batches)

    def reap(self) -> list[tuple[int, np.ndarray]]:
        self._usable()
        ready = self._unclaimed + self._reap_ready()
        self._unclaimed = []
        return ready

    def check_timeout(self, read_timeout_s: float) -> None:
        self._usable()
        age = self.oldest_inflight_s()
        if age is not None and age > read_timeout_s:
            self._fail(IOTimeoutError, f"a read has been in flight for {age:.3f} s, longer than "
                                       f"io.read_timeout_s = {read_timeout_s} s")

    def read(self, ops: np.ndarray, timeout_s: float = 60.0) -> None:
        batch_id = self.submit(ops)
        deadline = time.monotonic() + timeout_s
        poller = select.poll()
        poller.register(self.fileno(), select.POLLIN)
        while True:
            ready = self._reap_ready()
            self._unclaimed += [done for done in ready if done[0] != batch_id]
            if any(done[0] == batch_id for done in ready):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(IOTimeoutError, f"a read batch did not complete within "
                                           f"timeout_s = {timeout_s} s")
            poller.poll(min(left, READ_POLL_S) * 1000)


class UringEngine(_EngineBase):
    name = "uring"
    direct = True
    _ring = None  # the helper's ring; None before it opens and once closed

    def __init__(self, buffer, slot_bytes: int, n_slots: int, files: Sequence[Path],
                 depth: int, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        super().__init__(depth, drain_timeout_s)
        self._lib = _load_helper()
        self._buffer = buffer
        self._lock = threading.Lock()  # the helper is single-threaded
        self._batches: dict[int, np.ndarray] = {}  # the helper writes into these until reaped
        self._ids = (ctypes.c_uint64 * 256)()
        self._faults: dict[str, int] = {}
        self._last_stats = {"stale": 0, "faults_injected": 0}
        ring = ctypes.c_void_p()
        ret = self._lib.fm_ring_open(depth, _buffer_address(buffer), slot_bytes, n_slots,
                                     ctypes.byref(ring))
        _check_errno(ret, "io_uring setup / buffer registration")
        self._ring = ring
        self.drain_timeout_s = drain_timeout_s
        paths = (ctypes.c_char_p * len(files))(*[os.fsencode(p) for p in files])
        ret = self._lib.fm_ring_register_files(ring, paths, len(files))
        if ret < 0:
            self.close()
            _check_errno(ret, "opening stripe files with O_DIRECT")

    @property
    def drain_timeout_s(self) -> float:
        return self._drain_timeout_s

    @drain_timeout_s.setter
    def drain_timeout_s(self, seconds: float) -> None:
        self._drain_timeout_s = seconds
        if self._ring is not None:
            self._lib.fm_set_drain_timeout_ns(self._ring, max(1, int(seconds * 1e9)))

    def _closed(self) -> bool:
        return self._ring is None

    def fileno(self) -> int:
        self._usable()
        return self._lib.fm_ring_eventfd(self._ring)

    def submit(self, ops: np.ndarray) -> int:
        self._usable()
        _check_ops(ops)
        batch_id = ctypes.c_uint64()
        with self._lock:
            ret = self._lib.fm_submit(self._ring, ops.ctypes.data, len(ops),
                                      ctypes.byref(batch_id))
            if ret == -errno.EAGAIN:
                raise IOEngineError(f"{self._lib.fm_max_batches()} batches are outstanding; "
                                    f"reap before submitting more")
            self._batches[batch_id.value] = ops
        if ret < 0:
            self._fail(IOEngineError, f"io_uring submit failed: {os.strerror(-ret)} "
                                      f"(errno {-ret})")
        return batch_id.value

    def _reap_ready(self) -> list[tuple[int, np.ndarray]]:
        ready, ret = self._reap_ids()
        if ret < 0:
            self._unclaimed.extend(ready)
            self._fail(IOEngineError, f"io_uring submit failed while refilling the ring: "
                                      f"{os.strerror(-ret)} (errno {-ret})")
        return ready

    def _reap_ids(self) -> tuple[list[tuple[int, np.ndarray]], int]:
        """Every completed batch the helper hands out; stops at the helper's error."""
        ids, ret = [], 0
        with self._lock:
            while True:
                ret = self._lib.fm_reap(self._ring, self._ids, len(self._ids))
                if ret < 0:
                    break
                ids.extend(self._ids[:ret])
                if ret < len(self._ids):
                    ret = 0
                    break
            return [(i, self._batches.pop(i)) for i in ids], ret

    def _abandon(self) -> tuple[bool, list[tuple[int, np.ndarray]]]:
        with self._lock:
            error = self._lib.fm_ring_error(self._ring)
            if error == 0:
                error = self._lib.fm_ring_fail(self._ring, -errno.ECANCELED)
        batches, _ = self._reap_ids()
        return error != -errno.ETIMEDOUT, batches

    def inflight(self) -> int:
        return 0 if self._ring is None else self._lib.fm_inflight(self._ring)

    def queued(self) -> int:
        return 0 if self._ring is None else self._lib.fm_queued(self._ring)

    def oldest_inflight_s(self) -> float | None:
        if self._ring is None:
            return None
        with self._lock:
            t = self._lib.fm_oldest_submit_ns(self._ring)
        return None if t == 0 else (time.monotonic_ns() - t) / 1e9

    def inject_fault(self, kind: str, param: int) -> None:
        self._usable()
        if kind not in FAULT_KINDS or param < 0:
            raise IOEngineError(f"unknown fault {kind}:{param}; kinds: {', '.join(FAULT_KINDS)}")
        with self._lock:
            _check_errno(self._lib.fm_set_fault(self._ring, FAULT_KINDS[kind], param),
                         f"setting fault {kind}")
        self._faults[kind] = param

    def _read_counters(self) -> dict:
        return {"stale": self._lib.fm_stale_count(self._ring),
                "faults_injected": self._lib.fm_faults_injected(self._ring)}

    @property
    def stats(self) -> dict:
        counters = self._last_stats if self._ring is None else self._read_counters()
        return {**counters, "faults": {k: v for k, v in self._faults.items() if v}}

    def close(self) -> None:
        if self._ring is None:
            return
        with self._lock:
            # Drains what is in flight, or (after a drain timeout) what landed since: counted.
            ret = self._lib.fm_ring_fail(self._ring, -errno.ECANCELED)
            self._last_stats = self._read_counters()
            self._lib.fm_ring_close(self._ring)
            self._ring = None
        self._batches.clear()  # the helper no longer touches them
        if ret == -errno.ETIMEDOUT:
            log.error("io_uring engine closed with reads still in flight after the drain "
                      "timeout (%s s); their slots may still change", self.drain_timeout_s)


class _PreadBatch:
    __slots__ = ("ops", "remaining", "in_flight", "active")

    def __init__(self, ops: np.ndarray, remaining: int) -> None:
        self.ops = ops
        self.remaining = remaining  # valid reads not yet completed
        self.in_flight: set[int] = set()  # op indices a thread took and has not reported
        self.active = True


class PreadEngine(_EngineBase):
    """``depth`` threads take reads off one FIFO and ``preadv`` them into the slots; each
    completion goes onto a queue and is signalled through an eventfd, and ``reap`` (in the
    caller's thread) writes it into its batch after the same checks the helper makes."""

    name = "pread"

    def __init__(self, buffer, slot_bytes: int, n_slots: int, files: Sequence[Path],
                 depth: int, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        super().__init__(depth, drain_timeout_s)
        self._view = memoryview(buffer)
        self._slot_bytes = slot_bytes
        self._n_slots = n_slots
        self.direct = True
        self._fds: list[int] = []
        self._threads: list[threading.Thread] = []
        self._efd = -1
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    self.close()
                    raise IOEngineError(f"cannot open stripe {path}: {exc.strerror}") from None
                # The file system has no O_DIRECT (tmpfs): buffered reads, and say so.
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                self.direct = False
            self._fds.append(fd)
        self._cond = threading.Condition()
        self._batches: dict[int, _PreadBatch] = {}
        self._queue: deque[tuple[int, int]] = deque()  # (batch id, op index) not yet taken
        self._running: dict[tuple[int, int], int] = {}  # taken, not reported -> submit ns
        self._completions: deque[tuple[int, int, int, int, int]] = deque()
        self._done: list[int] = []  # completed batches not yet handed out
        self._next_id = 0
        self._stopping = False
        self._faults = {kind: 0 for kind in FAULT_KINDS}
        self._reads_started = 0
        self._counters = {"stale": 0, "faults_injected": 0}
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._threads = [threading.Thread(target=self._worker, name=f"pread-{i}", daemon=True)
                         for i in range(depth)]
        for thread in self._threads:
            thread.start()

    def _closed(self) -> bool:
        return self._efd < 0

    def fileno(self) -> int:
        self._usable()
        return self._efd

    def _signal(self) -> None:
        os.eventfd_write(self._efd, 1)

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                key = self._queue.popleft()
                if not self._queue:
                    self._cond.notify_all()  # a failing submit waits for its reads to go out
                batch = self._batches[key[0]]
                op = batch.ops[key[1]]
                fd = self._fds[int(op["file_index"])]
                start = int(op["buf_index"]) * self._slot_bytes + int(op["buf_offset"])
                length, offset = int(op["length"]), int(op["file_offset"])
                self._reads_started += 1
                every = self._faults["short_read"]
                if every and self._reads_started % every == 0 and length > SHORT_READ_BYTES:
                    length -= SHORT_READ_BYTES
                    self._counters["faults_injected"] += 1
                delay_ms = self._faults["delay"]
                batch.in_flight.add(key[1])
                t_submit = self._running[key] = time.monotonic_ns()
            try:
                result = os.preadv(fd, [self._view[start:start + length]], offset)
            except OSError as exc:
                result = -exc.errno
            if delay_ms:
                time.sleep(delay_ms / 1000)
            with self._cond:
                del self._running[key]
                if delay_ms:
                    self._counters["faults_injected"] += 1
                self._completions.append((*key, result, t_submit, time.monotonic_ns()))
                self._cond.notify_all()
            self._signal()

    def _valid(self, ops: np.ndarray) -> np.ndarray:
        return ((ops["buf_index"] >= 0) & (ops["buf_index"] < self._n_slots)
                & (ops["file_index"] >= 0) & (ops["file_index"] < len(self._fds))
                & (ops["length"] > 0)
                & (ops["buf_offset"] + ops["length"].astype(np.uint64) <= self._slot_bytes))

    def submit(self, ops: np.ndarray) -> int:
        self._usable()
        _check_ops(ops)
        valid = self._valid(ops)
        indices = np.flatnonzero(valid).tolist()
        fail_after = self._faults["submit_error"]
        with self._cond:
            self._next_id += 1
            batch_id = self._next_id
            ops["t_submit_ns"] = ops["t_complete_ns"] = 0
            ops["result"] = np.where(valid, IN_PROGRESS, -errno.EINVAL)
            self._batches[batch_id] = _PreadBatch(ops, len(indices))
            nothing_valid = not indices
            if nothing_valid:
                self._done.append(batch_id)
            if fail_after:
                # As the helper does: what fits of the first fail_after reads goes out (to an
                # idle thread, which takes it at once), the rest never does.
                idle = self.depth - len(self._running) - len(self._queue)
                indices = indices[:max(0, min(fail_after, idle))]
            self._queue.extend((batch_id, i) for i in indices)
            self._cond.notify_all()
            if fail_after:
                self._counters["faults_injected"] += 1
                self._cond.wait_for(lambda: not self._queue, PICKUP_TIMEOUT_S)
        if nothing_valid:
            self._signal()
        if fail_after:
            self._fail(IOEngineError, f"pread submit failed: {os.strerror(errno.EIO)} "
                                      f"(injected submit_error after {fail_after} reads)")
        return batch_id

    def _apply_completions(self) -> None:
        """Write the completions that came in; those of no read in flight are stale."""
        while self._completions:
            batch_id, i, result, t_submit, t_complete = self._completions.popleft()
            batch = self._batches.get(batch_id)
            if batch is None or not batch.active or i not in batch.in_flight:
                self._counters["stale"] += 1
                continue
            batch.in_flight.discard(i)
            op = batch.ops[i:i + 1]
            op["result"], op["t_submit_ns"], op["t_complete_ns"] = result, t_submit, t_complete
            batch.remaining -= 1
            if batch.remaining == 0:
                batch.active = False
                self._done.append(batch_id)

    def _reap_ready(self) -> list[tuple[int, np.ndarray]]:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        with self._cond:
            self._apply_completions()
            done, self._done = self._done, []
            return [(i, self._batches.pop(i).ops) for i in done]

    def _abandon(self) -> tuple[bool, list[tuple[int, np.ndarray]]]:
        with self._cond:
            self._queue.clear()  # never taken: canceled below
            drained = self._cond.wait_for(lambda: not self._running, self.drain_timeout_s)
            self._apply_completions()
            for batch_id, batch in self._batches.items():
                if batch.active:
                    unfinished = batch.ops["result"] == IN_PROGRESS
                    batch.ops["result"][unfinished] = -errno.ECANCELED
                    batch.active = False
                    self._done.append(batch_id)
            done, self._done = self._done, []
            return drained, [(i, self._batches.pop(i).ops) for i in done]

    def inflight(self) -> int:
        return len(self._running)

    def queued(self) -> int:
        return len(self._queue)

    def oldest_inflight_s(self) -> float | None:
        with self._cond:
            oldest = min(self._running.values(), default=None)
        return None if oldest is None else (time.monotonic_ns() - oldest) / 1e9

    def inject_fault(self, kind: str, param: int) -> None:
        self._usable()
        if kind not in FAULT_KINDS or param < 0:
            raise IOEngineError(f"unknown fault {kind}:{param}; kinds: {', '.join(FAULT_KINDS)}")
        with self._cond:
            if kind == "stale":
                self._forge_stale(param)
            else:
                self._faults[kind] = param

    def _forge_stale(self, count: int) -> None:
        """Completions that fail each check in turn: unknown batch, op index past the batch,
        an op no thread has taken."""
        live = next((i for i, b in self._batches.items() if b.active), None)
        for k in range(count):
            if live is None or k % 3 == 0:
                forged = (-1, 0)
            elif k % 3 == 1:
                forged = (live, len(self._batches[live].ops))
            else:
                batch = self._batches[live]
                forged = (live, next((i for i in range(len(batch.ops))
                                      if i not in batch.in_flight), len(batch.ops)))
            self._completions.append((*forged, -errno.EFAULT, 0, 0))
            self._counters["faults_injected"] += 1
        self._apply_completions()

    @property
    def stats(self) -> dict:
        return {**self._counters, "faults": {k: v for k, v in self._faults.items() if v}}

    def close(self) -> None:
        if self._efd < 0 and not self._fds:
            return
        drained = True
        if self._threads:
            drained, _ = self._abandon()
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
            for thread in self._threads:
                thread.join(timeout=self.drain_timeout_s if drained else 0)
        if any(thread.is_alive() for thread in self._threads):
            # A thread is stuck in preadv: its fd stays open so that it never reads another file.
            log.error("pread engine closed with a read still in flight after the drain timeout "
                      "(%s s); its slot may still change", self.drain_timeout_s)
        else:
            for fd in self._fds:
                os.close(fd)
        self._fds = []
        self._threads = []
        if self._efd >= 0:
            os.close(self._efd)
            self._efd = -1


ENGINES = {"uring": UringEngine, "pread": PreadEngine}


def _inject_env_faults(engine) -> None:
    spec = os.environ.get(FAULT_ENV, "").strip()
    if not spec:
        return
    faults = parse_fault_spec(spec)
    log.warning("!!! %s=%r: injecting IO faults into the %s engine; reads WILL be delayed, "
                "short or failed on purpose (testing only) !!!", FAULT_ENV, spec, engine.name)
    for kind, param in faults:
        engine.inject_fault(kind, param)


def open_engine(kind: str, buffer, slot_bytes: int, n_slots: int, files: Sequence[Path],
                depth: int) -> tuple[IOEngine, str]:
    """Open the requested engine; ``auto`` falls back to pread. Returns (engine, reason)."""
    if kind not in ("auto", *ENGINES):
        raise IOEngineError(f"unknown IO engine {kind!r}; choices: auto, {', '.join(ENGINES)}")
    reason = ""
    if kind != "auto":
        engine = ENGINES[kind](buffer, slot_bytes, n_slots, files, depth)
    else:
        try:
            engine = UringEngine(buffer, slot_bytes, n_slots, files, depth)
        except IOEngineError as exc:
            reason = str(exc)
            log.warning("io_uring engine unavailable (%s); using the pread thread-pool engine",
                        reason)
            engine = PreadEngine(buffer, slot_bytes, n_slots, files, depth)
    try:
        _inject_env_faults(engine)
    except IOEngineError:
        engine.close()
        raise
    return engine, reason
