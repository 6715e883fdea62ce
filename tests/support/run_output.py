"""The lines a running `flashmoe run` prints, read as they come."""

from __future__ import annotations

import re
import subprocess
import threading
import time


class RunOutput:
    """The lines `flashmoe run` prints, collected by a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, after: int = 0, timeout_s: float = 120.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines[after:]:
                match = re.search(pattern, line)
                if match:
                    return match
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s:\n" +
                             "\n".join(self.lines[-30:]))

    def tokens(self) -> float:
        for line in reversed(self.lines):
            match = re.search(r"\[run\]\s+([\d.]+) tokens", line)
            if match:
                return float(match.group(1))
        return 0.0


def summary_of(stdout: str) -> dict[str, str]:
    """The summary `flashmoe run` prints at its end (``key  value`` lines), as text."""
    return dict(line.split(None, 1) for line in stdout.splitlines()
                if line and not line.startswith("[") and len(line.split(None, 1)) == 2)
