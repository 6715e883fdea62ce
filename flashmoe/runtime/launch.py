"""Start FlashMoE services as real local processes (tests, benchmarks, `flashmoe run`).

Every child runs ``python -m flashmoe <service command>`` with its output in
``<runtime_dir>/<service>.log``; a child counts as started once its control socket answers a
health check, and one that dies before that raises ``ServiceStartError`` quoting the tail of
its log. Shared-memory arenas left in /dev/shm by dead processes are swept when a launcher
starts.

The runtime folder is private: made (or forced) to mode 0700 and owned by the user (a folder
of another user, or a link, is refused with ``RuntimeDirError``), and every file in it is
0600; children run with umask 077, so their sockets, logs and info files are the user's alone.
Children run in a session of their own (a Ctrl-C at the terminal reaches the launcher alone,
which stops them) and know the launcher's pid (``PARENT_PID_ENV``): they arm the parent-death
signal and exit if it is already gone.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.arena import sweep_stale_arenas
from common.bus import ServiceUnavailable, control_endpoint_for, health, ipc_endpoint
from common.config import FlashMoEConfig
from common.service import PARENT_PID_ENV

ROOT = Path(__file__).resolve().parents[2]
LOG_TAIL_LINES = 20


CHILD_UMASK = 0o077  # what a child makes is its user's alone


class ServiceStartError(RuntimeError):
    """A child service died or did not answer its health check at start."""


class RuntimeDirError(OSError):
    """The runtime folder cannot be made private (another user's, a link, not a folder)."""


class HomeInUse(RuntimeError):
    """Another `flashmoe run`/`serve` holds the home folder's lock."""


HOME_LOCK = "instance.lock"


def lock_home(home: Path, command: str):
    """An exclusive advisory lock on ``home`` (``<home>/instance.lock``, holding the pid) for
    as long as the returned file stays open; another holder raises ``HomeInUse`` naming its
    pid. The kernel lets go of it when the process ends, however it ends."""
    import fcntl

    home.mkdir(parents=True, exist_ok=True)
    path = home / HOME_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    lock = os.fdopen(fd, "r+")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = lock.read().strip() or "?"
        lock.close()
        raise HomeInUse(f"{home} is in use by another FlashMoE instance (pid {holder}); stop "
                        f"it, or give this {command} another --home") from None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def child_env() -> dict[str, str]:
    """This environment, the project on PYTHONPATH, and this process's pid as the child's
    parent (``PARENT_PID_ENV``)."""
    return {**os.environ, PARENT_PID_ENV: str(os.getpid()), "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def private_runtime_dir(path: Path) -> Path:
    """``path`` made (or forced) to mode 0700 with every file in it 0600; a folder of another
    user, or a link, is refused with ``RuntimeDirError`` (one line naming it)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"runtime folder {path} (ipc.runtime_dir) is not a folder but a "
                              f"link or a file; give a folder of your own")
    if info.st_uid != os.getuid():
        raise RuntimeDirError(f"runtime folder {path} (ipc.runtime_dir) belongs to uid "
                              f"{info.st_uid}, not to you (uid {os.getuid()}); give a folder "
                              f"of your own")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    for entry in path.iterdir():
        mode = os.lstat(entry).st_mode
        if stat.S_ISREG(mode) and stat.S_IMODE(mode) & 0o077:
            os.chmod(entry, stat.S_IMODE(mode) & 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, readable by its user alone (0600 from the start)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def open_log(path: Path):
    """A child's log, appended to, 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def popen_child(command: list[str], env: dict | None, log_file) -> subprocess.Popen:
    """A child process as the launcher starts it: its output in ``log_file``, umask 077, a
    session of its own."""
    return subprocess.Popen(command, env={**child_env(), **(env or {})}, stdout=log_file,
                            stderr=subprocess.STDOUT, umask=CHILD_UMASK,
                            start_new_session=True)


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


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0, sig: int = signal.SIGTERM,
                 kill_group: bool = False) -> int:
    """``sig`` (SIGTERM), then SIGKILL after ``timeout_s`` (to the process's whole group with
    ``kill_group``: a child started with ``start_new_session``); returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            if kill_group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()
    return proc.returncode


class Launcher:
    """Starts services in one runtime folder with one config (written to
    ``<runtime_dir>/config.json`` and passed to every child), and stops them all."""

    def __init__(self, config: FlashMoEConfig, runtime_dir: Path) -> None:
        self.config = config
        self.runtime_dir = private_runtime_dir(runtime_dir)
        self.children: dict[str, Child] = {}
        self.swept = sweep_stale_arenas()
        self.config_path = runtime_dir / "config.json"
        write_private(self.config_path, json.dumps(config.to_dict(), indent=1))

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
            with open_log(log_path) as log_file:
                proc = popen_child(cli_command(*args), env, log_file)
            child = Child(service, proc, log_path, endpoint, control, args)
            self.children[service] = child
            started.append(child)
        try:
            for child in started:
                wait_healthy(child.proc, child.control_endpoint, child.log_path, child.service,
                             ready_timeout_s)
        except BaseException:  # a child that failed, or a stop (Interrupted) meanwhile
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
        with open_log(log_path) as log_file:
            return popen_child(cli_command(*command, "--config", str(self.config_path)), env,
                               log_file)

    def stop_all(self, timeout_s: float = 10.0) -> dict[str, int]:
        codes = {name: stop_process(child.proc, timeout_s)
                 for name, child in reversed(list(self.children.items()))}
        self.children.clear()
        return codes
