"""IO engines that read store blocks into arena slots.

``UringEngine`` drives the liburing C helper (``csrc/flashmoe_io.c``): arena slots registered
as fixed buffers, stripe files opened O_DIRECT and registered as fixed files, reads issued with
``io_uring_prep_read_fixed`` at a configurable queue depth. ``PreadEngine`` is the fallback
where the helper is not built, liburing is missing or io_uring is blocked: a pool of ``depth``
threads issuing ``preadv`` into the same slots. ``open_engine("auto", ...)`` picks the first
that works and says why in ``fallback_reason``.

Both take a batch of ``READ_OP_DTYPE`` records and fill in each record's ``result`` and
submit/complete timestamps.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from common.store import READ_OP_DTYPE

log = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).parent / "csrc"
HELPER_SOURCE = CSRC_DIR / "flashmoe_io.c"
HELPER_LIBRARY = CSRC_DIR / "libflashmoe_io.so"
HELPER_ABI_VERSION = 1


class IOEngineError(RuntimeError):
    """An IO engine cannot be created or its ring failed."""


class IOEngine(Protocol):
    name: str
    direct: bool  # True when reads bypass the page cache (O_DIRECT)

    def read(self, ops: np.ndarray) -> None:
        """Run every read of ``ops`` (READ_OP_DTYPE) and fill in results and timestamps."""

    def close(self) -> None: ...


def build_helper(force: bool = False) -> Path:
    """Compile the C helper with the system compiler and liburing; returns the library path."""
    if HELPER_LIBRARY.exists() and not force and (
            HELPER_LIBRARY.stat().st_mtime >= HELPER_SOURCE.stat().st_mtime):
        return HELPER_LIBRARY
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise IOEngineError("no C compiler found to build the io_uring helper (set CC)")
    tmp = HELPER_LIBRARY.with_suffix(".so.tmp")
    cmd = [compiler, "-O2", "-Wall", "-Wextra", "-shared", "-fPIC", "-o", str(tmp),
           str(HELPER_SOURCE), "-luring"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise IOEngineError(f"building the io_uring helper failed ({' '.join(cmd)}):\n"
                            f"{proc.stderr.strip()}\n(is liburing-dev installed?)")
    os.replace(tmp, HELPER_LIBRARY)
    return HELPER_LIBRARY


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
    lib.fm_ring_open.argtypes = [ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint,
                                 ctypes.POINTER(ctypes.c_void_p)]
    lib.fm_ring_register_files.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_char_p),
                                           ctypes.c_uint]
    lib.fm_ring_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    lib.fm_ring_close.argtypes = [ctypes.c_void_p]
    lib.fm_ring_close.restype = None
    return lib


def _buffer_address(buffer) -> int:
    """Address of a writable buffer (mmap, bytearray) without copying it."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _check_errno(ret: int, what: str) -> None:
    if ret < 0:
        raise IOEngineError(f"{what}: {os.strerror(-ret)} (errno {-ret})")


class UringEngine:
    name = "uring"
    direct = True

    def __init__(self, buffer, slot_bytes: int, n_slots: int, files: Sequence[Path],
                 depth: int) -> None:
        self._lib = _load_helper()
        self._buffer = buffer
        self._lock = threading.Lock()  # one batch on the ring at a time
        ring = ctypes.c_void_p()
        ret = self._lib.fm_ring_open(depth, _buffer_address(buffer), slot_bytes, n_slots,
                                     ctypes.byref(ring))
        _check_errno(ret, "io_uring setup / buffer registration")
        self._ring = ring
        paths = (ctypes.c_char_p * len(files))(*[os.fsencode(p) for p in files])
        ret = self._lib.fm_ring_register_files(self._ring, paths, len(files))
        if ret < 0:
            self.close()
            _check_errno(ret, "opening stripe files with O_DIRECT")

    def read(self, ops: np.ndarray) -> None:
        assert ops.dtype == READ_OP_DTYPE and ops.flags.c_contiguous
        with self._lock:
            if self._ring is None:
                raise IOEngineError("io_uring engine is closed")
            ret = self._lib.fm_ring_read(self._ring, ops.ctypes.data, len(ops))
        _check_errno(ret, "io_uring wait")

    def close(self) -> None:
        if getattr(self, "_ring", None) is not None:
            self._lib.fm_ring_close(self._ring)
            self._ring = None


class PreadEngine:
    name = "pread"

    def __init__(self, buffer, slot_bytes: int, n_slots: int, files: Sequence[Path],
                 depth: int) -> None:
        self._view = memoryview(buffer)
        self._slot_bytes = slot_bytes
        self._n_slots = n_slots
        self.direct = True
        self._fds = []
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
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="pread")

    def _one(self, ops: np.ndarray, i: int) -> None:
        op = ops[i]
        slot, offset, length = int(op["buf_index"]), int(op["buf_offset"]), int(op["length"])
        file_index = int(op["file_index"])
        if not (0 <= slot < self._n_slots and 0 <= file_index < len(self._fds) and length > 0
                and offset + length <= self._slot_bytes):
            ops[i]["result"] = -errno.EINVAL
            return
        start = slot * self._slot_bytes + offset
        ops[i]["t_submit_ns"] = time.monotonic_ns()
        try:
            ops[i]["result"] = os.preadv(self._fds[file_index],
                                         [self._view[start:start + length]],
                                         int(op["file_offset"]))
        except OSError as exc:
            ops[i]["result"] = -exc.errno
        ops[i]["t_complete_ns"] = time.monotonic_ns()

    def read(self, ops: np.ndarray) -> None:
        assert ops.dtype == READ_OP_DTYPE
        list(self._pool.map(lambda i: self._one(ops, i), range(len(ops))))

    def close(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []


ENGINES = {"uring": UringEngine, "pread": PreadEngine}


def open_engine(kind: str, buffer, slot_bytes: int, n_slots: int, files: Sequence[Path],
                depth: int) -> tuple[IOEngine, str]:
    """Open the requested engine; ``auto`` falls back to pread. Returns (engine, reason)."""
    if kind not in ("auto", *ENGINES):
        raise IOEngineError(f"unknown IO engine {kind!r}; choices: auto, {', '.join(ENGINES)}")
    if kind != "auto":
        return ENGINES[kind](buffer, slot_bytes, n_slots, files, depth), ""
    try:
        return UringEngine(buffer, slot_bytes, n_slots, files, depth), ""
    except IOEngineError as exc:
        reason = str(exc)
        log.warning("io_uring engine unavailable (%s); using the pread thread-pool engine",
                    reason)
        return PreadEngine(buffer, slot_bytes, n_slots, files, depth), reason
