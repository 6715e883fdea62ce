"""A cache-manager process started for a test, with its control socket and its log."""

from __future__ import annotations

import time
from pathlib import Path

from common.bus import control_endpoint_for, ipc_endpoint, stats
from flashmoe.runtime.launch import start_cache_manager, stop_process


class ManagerHandle:
    def __init__(self, store: Path, runtime: Path, overrides: list[str],
                 env: dict | None = None) -> None:
        self.endpoint = ipc_endpoint(runtime, "cache")
        self.control = control_endpoint_for(self.endpoint)
        self.log_path = runtime / "cache_manager.log"
        self._log = open(self.log_path, "w")
        self.proc = start_cache_manager(store, self.endpoint, overrides, log_file=self._log,
                                        env=env)

    def stats(self) -> dict:
        return stats(self.control)

    def wait_for(self, condition, timeout_s: float = 20.0, what: str = "") -> dict:
        """Poll the control socket's stats until ``condition(stats)`` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            current = self.stats()
            if condition(current):
                return current
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what or condition}: {current}")
            time.sleep(0.05)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> int:
        rc = stop_process(self.proc)
        self._log.close()
        return rc
