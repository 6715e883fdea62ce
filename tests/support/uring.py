"""Whether this machine can run the io_uring engine, and why not."""

from __future__ import annotations


def uring_available() -> tuple[bool, str]:
    """(True, "") when the helper is built (rebuilt here when its source is newer), loads, and
    this process may set up an io_uring instance; else (False, why)."""
    from services.cache_manager.io_engine import IOEngineError, build_helper, probe_uring

    try:
        build_helper()
        probe_uring()
        return True, ""
    except IOEngineError as exc:
        return False, str(exc)
