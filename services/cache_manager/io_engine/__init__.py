"""IO engines that read store blocks into arena slots, asynchronously.

  base.py    the interface (``IOEngine``), its errors, what both engines share
  uring.py   ``UringEngine``: the liburing C helper, fixed buffers and files, O_DIRECT
  pread.py   ``PreadEngine``: ``depth`` threads issuing ``preadv``, the fallback
  faults.py  ``IOFaults``: the faults an engine can inject (testing only)

``open_engine("auto", ...)`` picks the first engine that works and says why in its reason.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from common.store import READ_OP_DTYPE

from .base import (DEFAULT_DRAIN_TIMEOUT_S, EngineBase, IOEngine, IOEngineError,
                   IOTimeoutError)
from .faults import FAULT_ENV, FAULT_KINDS, SHORT_READ_BYTES, IOFaults, parse_fault_spec
from .pread import PreadEngine
from .uring import HELPER_LIBRARY, UringEngine, build_helper, probe_uring

__all__ = ["DEFAULT_DRAIN_TIMEOUT_S", "ENGINES", "FAULT_ENV", "FAULT_KINDS", "HELPER_LIBRARY",
           "READ_OP_DTYPE", "SHORT_READ_BYTES", "EngineBase", "IOEngine", "IOEngineError",
           "IOFaults", "IOTimeoutError", "PreadEngine", "UringEngine", "build_helper",
           "open_engine", "parse_fault_spec", "probe_uring"]

log = logging.getLogger(__name__)

ENGINES = {"uring": UringEngine, "pread": PreadEngine}


def open_engine(kind: str, buffer, slot_bytes: int, n_slots: int, files: Sequence[Path],
                depth: int, faults: IOFaults | None = None) -> tuple[IOEngine, str]:
    """Open the requested engine; ``auto`` falls back to pread. Returns (engine, reason).
    ``faults`` are armed at once (by default those ``FMIO_FAULT`` declares)."""
    if kind not in ("auto", *ENGINES):
        raise IOEngineError(f"unknown IO engine {kind!r}; choices: auto, {', '.join(ENGINES)}")
    if faults is None:
        faults = IOFaults.from_env()
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
        faults.arm(engine)
    except IOEngineError:
        engine.close()
        raise
    return engine, reason
