"""Start FlashMoE services as real local processes (tests, benchmarks, `flashmoe run`).

Every child runs ``python -m flashmoe <service command>`` with its output in
``<runtime_dir>/<service>.log``; a child counts as started once its control socket answers a
health check, and one that dies before that raises ``ServiceStartError`` quoting the tail of
its log. Shared-memory arenas left in /dev/shm by dead processes are swept when a launcher
starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.arena import sweep_stale_arenas
from common.bus import ServiceUnavailable, control_endpoint_for, health, ipc_endpoint
from common.config import FlashMoEConfig

ROOT = Path(__file__).resolve().parents[2]
LOG_TAIL_LINES = 20


class ServiceStartError(RuntimeError):
    """A child service died or did not answer its health check at start."""


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "flashmoe", *args]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Child:
    service: str
    proc: subprocess.Popen
    log_path: Path
    endpoint: str
    control_endpoint: str
    args: list[str] = field(default_factory=list)


def start_cache_manager(store: str | Path, endpoint: str, overrides=(), log_file=None,
                        control_endpoint: str | None = None,
                        env: dict | None = None) -> subprocess.Popen:
    """Run `flashmoe serve-cache` in a child process; the caller's CacheClient waits for
    READY (or ``wait_healthy`` for its control socket)."""
    cmd = cli_command("serve-cache", str(store), "--endpoint", endpoint)
    if control_endpoint:
        cmd += ["--control-endpoint", control_endpoint]
    for item in overrides:
        cmd += ["--set", item]
    return subprocess.Popen(cmd, env={**child_env(), **(env or {})},
                            stdout=log_file or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if log_file else subprocess.DEVNULL)


def wait_healthy(proc: subprocess.Popen, control_endpoint: str, log_path: Path | None,
                 service: str, timeout_s: float = 60.0) -> None:
    """Until the control socket answers; a child that exits first, or a timeout, raises
    ServiceStartError with the tail of its log."""
    deadline = time.monotonic() + timeout_s
    while True:
        rc = proc.poll()
        if rc is not None:
            tail = log_tail(log_path) if log_path else "(no log kept)"
            raise ServiceStartError(f"{service} exited with status {rc} at start; the end of "
                                    f"its log ({log_path}):\n{tail}")
        try:
            health(control_endpoint, timeout_s=0.5)
            return
        except ServiceUnavailable:
            if time.monotonic() > deadline:
                tail = log_tail(log_path) if log_path else "(no log kept)"
                raise ServiceStartError(f"{service} did not answer its health check on "
                                        f"{control_endpoint} within {timeout_s:g} s; the end "
                                        f"of its log ({log_path}):\n{tail}") from None


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


class Launcher:
    """Starts services in one runtime folder with one config (written to
    ``<runtime_dir>/config.json`` and passed to every child), and stops them all."""

    def __init__(self, config: FlashMoEConfig, runtime_dir: Path) -> None:
        self.config = config
        self.runtime_dir = runtime_dir
        runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.children: dict[str, Child] = {}
        self.swept = sweep_stale_arenas()
        self.config_path = runtime_dir / "config.json"
        self.config_path.write_text(json.dumps(config.to_dict(), indent=1))

    def endpoint(self, service: str) -> str:
        """The main endpoint a service of this launcher binds (known before it starts)."""
        return ipc_endpoint(self.runtime_dir, service)

    def start(self, service: str, command: list[str], ready_timeout_s: float = 60.0,
              env: dict | None = None) -> Child:
        """``command``: the CLI words of the service (``serve-cache STORE``...); endpoint,
        control endpoint and config file are added."""
        return self.start_together([(service, command)], ready_timeout_s, env)[0]

    def start_together(self, services: list[tuple[str, list[str]]],
                       ready_timeout_s: float = 60.0, env: dict | None = None) -> list[Child]:
        """Start every service at once (their start-ups overlap), then wait until each is
        healthy; one that fails stops the others started here."""
        started = []
        for service, command in services:
            endpoint = self.endpoint(service)
            control = control_endpoint_for(endpoint)
            log_path = self.runtime_dir / f"{service}.log"
            args = [*command, "--endpoint", endpoint, "--control-endpoint", control,
                    "--config", str(self.config_path)]
            with open(log_path, "ab") as log_file:
                proc = subprocess.Popen(cli_command(*args), env={**child_env(), **(env or {})},
                                        stdout=log_file, stderr=subprocess.STDOUT)
            child = Child(service, proc, log_path, endpoint, control, args)
            self.children[service] = child
            started.append(child)
        try:
            for child in started:
                wait_healthy(child.proc, child.control_endpoint, child.log_path, child.service,
                             ready_timeout_s)
        except ServiceStartError:
            for child in started:
                stop_process(child.proc)
                del self.children[child.service]
            raise
        return started

    def start_plain(self, service: str, command: list[str],
                    env: dict | None = None) -> subprocess.Popen:
        """A process without a control socket (a worker): its log, the config file, no
        health check."""
        log_path = self.runtime_dir / f"{service}.log"
        with open(log_path, "ab") as log_file:
            return subprocess.Popen(cli_command(*command, "--config", str(self.config_path)),
                                    env={**child_env(), **(env or {})}, stdout=log_file,
                                    stderr=subprocess.STDOUT)

    def stop_all(self, timeout_s: float = 10.0) -> dict[str, int]:
        codes = {name: stop_process(child.proc, timeout_s)
                 for name, child in reversed(list(self.children.items()))}
        self.children.clear()
        return codes
