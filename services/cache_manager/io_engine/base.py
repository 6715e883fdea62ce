"""What both IO engines share: the interface (``IOEngine``), its errors, and ``EngineBase``
(the failed state, ``check_timeout`` and the synchronous ``read`` built on submit / reap).

``submit`` hands over a batch of ``READ_OP_DTYPE`` records and returns at once; ``fileno``
becomes readable when completions are there; ``reap`` (never blocking) returns the batches that
completed, each record's ``result`` and timestamps filled in. At most ``depth`` reads are in
flight (``inflight``); the rest of the submitted reads wait in the engine's queue (``queued``)
and go out as earlier ones complete, which happens inside ``reap``.

Failure: when a submit fails, a read outlives ``check_timeout``'s limit or a ``read`` times
out, the engine first drains every read in flight (bounded by ``drain_timeout_s``), completes
every batch not yet reaped with ``-ECANCELED`` on its unfinished reads, and raises
``IOEngineError`` (``IOTimeoutError`` for timeouts) carrying those batches in ``.batches``.
The engine is failed from then on: every later call raises ``IOEngineError``.
"""

from __future__ import annotations

import errno
import logging
import select
import time
from typing import NoReturn, Protocol, Sequence

import numpy as np

from common.store import READ_OP_DTYPE

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 10.0
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



def check_ops(ops: np.ndarray) -> None:
    if ops.dtype != READ_OP_DTYPE or ops.ndim != 1 or not ops.flags.c_contiguous or \
            not ops.flags.writeable:
        raise ValueError("ops must be a writeable, contiguous 1-d READ_OP_DTYPE array")



class EngineBase:
    """What both engines share: the failed state, ``read`` and ``check_timeout`` on top of
    submit / reap, and batches reaped by ``read`` that belong to the caller's ``reap``.

    An engine adds ``submit``, ``fileno``, ``oldest_inflight_s``, ``_closed``, ``_reap_ready``
    (the completed batches, failing the engine on a ring error) and ``_abandon`` (drain with
    the bound, complete every batch; returns (drained, those batches))."""

    name: str
    # Reads land in arena slots registered with the kernel (io_uring fixed buffers); where
    # they are not, ``fixed_buffers_reason`` says why.
    fixed_buffers = False
    fixed_buffers_reason = "the pread engine registers no buffers"

    def __init__(self, depth: int, drain_timeout_s: float) -> None:
        if depth < 1:
            raise IOEngineError(f"queue depth must be at least 1, got {depth}")
        self.depth = depth
        self.drain_timeout_s = drain_timeout_s
        self._failure: str | None = None
        self._unclaimed: list[tuple[int, np.ndarray]] = []
        # Called with the reason when the engine fails, before it drains the reads in flight
        # (a drain can take drain_timeout_s): its owner answers whoever waits on a read.
        self.on_failing = None
        self.drain_timed_out = False  # a failure's drain ended with reads still in flight
        self._eio_every = 0  # the eio fault: every N-th expert read reports EIO
        self._expert_reads = 0
        self.eio_injected = 0

    def _set_eio(self, every: int) -> None:
        self._eio_every, self._expert_reads = every, 0

    def _inject_eio(self, ready: list[tuple[int, np.ndarray]]) -> None:
        """The eio fault: every N-th expert read (a run of a batch's ops into one slot)
        completes with -EIO in its first op, whatever the disk did."""
        every = self._eio_every
        for _, ops in ready:
            slots = ops["buf_index"]
            starts = np.flatnonzero(np.diff(slots) != 0) + 1 if len(ops) > 1 else []
            for start in (0, *starts):
                self._expert_reads += 1
                if self._expert_reads % every == 0:
                    ops["result"][start] = -errno.EIO
                    self.eio_injected += 1

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
        if self.on_failing is not None:
            try:
                self.on_failing(reason)
            except Exception:  # the failure goes on being handled
                log.exception("the IO engine's on_failing hook failed")
        drained, batches = self._abandon()
        batches = self._unclaimed + batches
        self._unclaimed = []
        if drained:
            reason += "; every read in flight was drained first"
        else:
            self.drain_timed_out = True
            reason += (f"; reads were still in flight after the drain timeout "
                       f"({self.drain_timeout_s} s) and may still land in their slots")
        self._failure = reason
        log.error("%s IO engine failed: %s", self.name, reason)
        raise error(reason, batches)

    def reap(self) -> list[tuple[int, np.ndarray]]:
        self._usable()
        fresh = self._reap_ready()
        if self._eio_every:
            self._inject_eio(fresh)
        ready = self._unclaimed + fresh
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
            if self._eio_every:
                self._inject_eio(ready)
            self._unclaimed += [done for done in ready if done[0] != batch_id]
            if any(done[0] == batch_id for done in ready):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(IOTimeoutError, f"a read batch did not complete within "
                                           f"timeout_s = {timeout_s} s")
            poller.poll(min(left, READ_POLL_S) * 1000)


