"""A live service's stats, awaited over its control socket."""

from __future__ import annotations

import time

from common.bus import ServiceUnavailable, stats


def wait_for(endpoint: str, condition, timeout_s: float = 60.0, what: str = "") -> dict:
    """The service's stats once ``condition(stats)`` holds; fails the test at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    current = None
    while True:
        try:
            current = stats(endpoint)
        except ServiceUnavailable:  # busy (a slow machine): ask again until the deadline
            current = None
        if current is not None and condition(current):
            return current
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {current}"
        time.sleep(0.1)
