"""The io_uring engine: the liburing C helper (``csrc/flashmoe_io.c``) with arena slots
registered as fixed buffers, stripe files opened O_DIRECT and registered as fixed files, reads
issued with ``io_uring_prep_read_fixed``. Where the slots cannot be registered (pinned memory
is charged to RLIMIT_MEMLOCK, which a container may not raise) the reads go to them
unregistered: still io_uring and O_DIRECT, and ``fixed_buffers`` says False and why.
``build_helper`` compiles the helper;
``probe_uring`` says whether this process may set up a ring.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from common.cbuild import BuildError, build_library
from common.store import READ_OP_DTYPE

from .base import DEFAULT_DRAIN_TIMEOUT_S, EngineBase, IOEngineError, check_ops
from .faults import check_fault

log = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parents[1] / "csrc"
HELPER_SOURCE = CSRC_DIR / "flashmoe_io.c"
HELPER_LIBRARY = CSRC_DIR / "libflashmoe_io.so"
HELPER_ABI_VERSION = 3
# Fault kind -> the helper's FM_FAULT_* number.
HELPER_FAULTS = {"delay": 1, "short_read": 2, "submit_error": 3, "stale": 4}

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
        "fm_ring_fixed_buffers": ([ring, ctypes.POINTER(ctypes.c_int)], ctypes.c_int),
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



class UringEngine(EngineBase):
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
        _check_errno(ret, "io_uring setup")
        self._ring = ring
        error = ctypes.c_int(0)
        self.fixed_buffers = bool(self._lib.fm_ring_fixed_buffers(ring, ctypes.byref(error)))
        self.fixed_buffers_reason = ""
        if not self.fixed_buffers:
            limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
            shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes"
            self.fixed_buffers_reason = (
                f"registering the arena ({slot_bytes * n_slots} bytes) as fixed buffers "
                f"failed: {os.strerror(-error.value)} (errno {-error.value}; memlock limit "
                f"{shown}); reads go to the slots unregistered")
            log.warning("io_uring: %s", self.fixed_buffers_reason)
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
        check_ops(ops)
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
        check_fault(kind, param)
        if kind == "eio":  # applied to completions as they are reaped (engines' base)
            self._set_eio(param)
        else:
            with self._lock:
                _check_errno(self._lib.fm_set_fault(self._ring, HELPER_FAULTS[kind], param),
                             f"setting fault {kind}")
        self._faults[kind] = param

    def _read_counters(self) -> dict:
        return {"stale": self._lib.fm_stale_count(self._ring),
                "faults_injected": self._lib.fm_faults_injected(self._ring) + self.eio_injected}

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


