"""The pread engine, the fallback where the io_uring helper is not built, liburing is missing
or io_uring is blocked: ``depth`` threads issuing ``preadv`` into the same arena slots.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Sequence

import numpy as np

from .base import DEFAULT_DRAIN_TIMEOUT_S, IN_PROGRESS, EngineBase, IOEngineError, check_ops
from .faults import FAULT_KINDS, SHORT_READ_BYTES, check_fault

log = logging.getLogger(__name__)

# An idle pread thread takes a queued read at once; only bounds a hang of the fault path.
PICKUP_TIMEOUT_S = 10.0


class _PreadBatch:
    __slots__ = ("ops", "remaining", "in_flight", "active")

    def __init__(self, ops: np.ndarray, remaining: int) -> None:
        self.ops = ops
        self.remaining = remaining  # valid reads not yet completed
        self.in_flight: set[int] = set()  # op indices a thread took and has not reported
        self.active = True


class PreadEngine(EngineBase):
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
        check_ops(ops)
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
        check_fault(kind, param)
        with self._cond:
            if kind == "stale":
                self._forge_stale(param)
            else:
                self._faults[kind] = param
                if kind == "eio":
                    self._set_eio(param)

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
        counters = {**self._counters}
        counters["faults_injected"] += self.eio_injected
        return {**counters, "faults": {k: v for k, v in self._faults.items() if v}}

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


