"""Start FlashMoE services as real local processes (tests, benchmarks, `flashmoe run`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path


def private_runtime_dir() -> Path:
    """A fresh folder for ipc sockets, readable by this user only."""
    return Path(tempfile.mkdtemp(prefix="flashmoe-run-"))


def ipc_endpoint(runtime_dir: Path, name: str) -> str:
    return f"ipc://{runtime_dir / name}.sock"


def start_cache_manager(store: str | Path, endpoint: str, overrides: list[str] = (),
                        log_file=None) -> subprocess.Popen:
    """Run `flashmoe serve-cache` in a child process; the caller's CacheClient waits for READY."""
    cmd = [sys.executable, "-m", "flashmoe.cli", "serve-cache", str(store), "--endpoint", endpoint]
    for item in overrides:
        cmd += ["--set", item]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(cmd, env=env, stdout=log_file or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if log_file else subprocess.DEVNULL)


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
