"""Supervision of FlashMoE's local processes (`flashmoe run`).

Each service is started through the ``Launcher`` (its log in ``<runtime_dir>/<service>.log``,
healthy once its control socket answers). A service that exits is restarted after a back-off
(``BACKOFF_S``, doubling up to ``BACKOFF_MAX_S``); one that dies ``GIVE_UP_AFTER`` times in a
row before it had run ``STABLE_S`` seconds is given up on, and the run ends with the tail of
its log (a broken store, say, cannot be fixed by restarting). One that exits with status
``REFUSED_STATUS`` (2: refused by a peer or the system, e.g. a worker of another config or
model shape, a port in use) is not restarted at all: the run ends with that reason, one line. ``stop`` ends everything in
reverse order (SIGTERM, then SIGKILL after a grace period) and leaves no process, socket file
or shared-memory arena behind.

The socket files of a run are known before it starts (each service's endpoint and control
socket, and what its spec lists in ``sockets``): at start, one that nothing answers on (left
by a run that was killed) is removed and one that something answers on is refused
(``SupervisionError``: another instance uses the runtime folder); at stop, those alone are
removed, never another file of the folder.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.arena import sweep_stale_arenas
from common.config import FlashMoEConfig
from flashmoe.runtime.launch import Child, Launcher, ServiceStartError, log_tail

log = logging.getLogger("flashmoe.supervisor")

BACKOFF_S = 0.5
BACKOFF_MAX_S = 15.0
STABLE_S = 20.0
GIVE_UP_AFTER = 5
REFUSED_STATUS = 2  # a service refused by a peer or the system (a config, a shape, a port)


def last_error(path: Path) -> str:
    """The last line of a log that says what went wrong (else its last line)."""
    lines = [line for line in log_tail(path, 50).splitlines() if line.strip()]
    errors = [line for line in lines if "ERROR" in line or "error:" in line]
    return (errors or lines or ["(no log)"])[-1].strip()


class SupervisionError(RuntimeError):
    """A service cannot be kept running."""


@dataclass
class ServiceSpec:
    name: str
    command: list[str]  # CLI words; the launcher adds endpoints and the config file
    health_checked: bool = True  # False: a process without a control socket (the worker)
    restart: bool = True
    exits_when_done: bool = False  # its clean exit ends the run (the worker with --tokens)
    env: dict[str, str] = field(default_factory=dict)  # added to the child's environment
    sockets: list[str] = field(default_factory=list)  # ipc endpoints it binds beyond its own


@dataclass
class Tracked:
    spec: ServiceSpec
    child: Child | None = None
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0
    next_start: float = 0.0
    exit_codes: list[int] = field(default_factory=list)


def answers(path: Path) -> bool:
    """Whether a process listens on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
            return True
        except OSError:
            return False


def sweep_stale_sockets(paths: list[Path]) -> list[Path]:
    """Remove the socket files of ``paths`` that nothing answers on (a killed run's); one
    that a live process answers on raises ``SupervisionError``. Returns those removed."""
    removed = []
    for path in paths:
        if not path.exists() and not path.is_symlink():
            continue
        if answers(path):
            raise SupervisionError(f"{path} is in use by a live process: another FlashMoE "
                                   f"instance uses the runtime folder {path.parent}; stop it, "
                                   f"or give this one another ipc.runtime_dir")
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


class Supervisor:
    def __init__(self, config: FlashMoEConfig, runtime_dir: Path,
                 specs: list[ServiceSpec]) -> None:
        self.launcher = Launcher(config, runtime_dir)
        self.tracked = {spec.name: Tracked(spec) for spec in specs}
        self.done = False

    def endpoint(self, service: str) -> str:
        return self.launcher.endpoint(service)

    def control_endpoint(self, service: str) -> str:
        from common.bus import control_endpoint_for

        return control_endpoint_for(self.endpoint(service))

    def socket_paths(self) -> list[Path]:
        """The socket files this run's services make (and nothing else of the folder)."""
        endpoints = []
        for t in self.tracked.values():
            if t.spec.health_checked:
                endpoints += [self.endpoint(t.spec.name), self.control_endpoint(t.spec.name)]
            endpoints += t.spec.sockets
        return [Path(e[len("ipc://"):]) for e in endpoints if e.startswith("ipc://")]

    # --- starting ---------------------------------------------------------------------------

    def _start(self, t: Tracked) -> None:
        spec = t.spec
        t.started = time.monotonic()
        if spec.health_checked:
            t.child = self.launcher.start(spec.name, spec.command, env=spec.env)
            t.proc = t.child.proc
        else:
            t.proc = self.launcher.start_plain(spec.name, spec.command, env=spec.env)

    def start_all(self) -> None:
        swept = sweep_stale_sockets(self.socket_paths())
        if swept:
            log.info("removed stale socket files %s", [p.name for p in swept])
        for t in self.tracked.values():
            try:
                self._start(t)
            except BaseException:  # a service that failed, or a stop (Interrupted) meanwhile
                self.stop()
                raise

    # --- watching ---------------------------------------------------------------------------

    def poll(self) -> list[str]:
        """Check every process once: restart what exited (after its back-off); returns
        messages for the user. Sets ``done`` when a service that ends the run finished."""
        messages = []
        now = time.monotonic()
        for t in self.tracked.values():
            if t.proc is None:
                if now >= t.next_start:
                    messages.append(self._restart(t))
                continue
            code = t.proc.poll()
            if code is None:
                if now - t.started > STABLE_S:
                    t.quick_deaths = 0
                continue
            t.exit_codes.append(code)
            t.proc = None
            if t.spec.exits_when_done and code == 0:
                self.done = True
                messages.append(f"{t.spec.name} finished")
                continue
            if not t.spec.restart:
                raise SupervisionError(f"{t.spec.name} exited with status {code}:\n"
                                       f"{log_tail(self._log_path(t))}")
            if code == REFUSED_STATUS:
                raise SupervisionError(
                    f"{t.spec.name} was refused, which a restart cannot change: "
                    f"{last_error(self._log_path(t))} (its log: {self._log_path(t)})")
            t.quick_deaths += 1 if now - t.started < STABLE_S else 0
            if t.quick_deaths >= GIVE_UP_AFTER:
                raise SupervisionError(
                    f"{t.spec.name} died {t.quick_deaths} times in a row within {STABLE_S:g} s "
                    f"of starting (last status {code}); giving up. The end of its log "
                    f"({self._log_path(t)}):\n{log_tail(self._log_path(t))}")
            delay = min(BACKOFF_S * 2 ** max(t.quick_deaths - 1, 0), BACKOFF_MAX_S)
            t.next_start = now + delay
            swept = sweep_stale_arenas()
            messages.append(f"{t.spec.name} exited with status {code}; restarting in "
                            f"{delay:.1f} s" + (f" (removed stale arenas {swept})" if swept
                                                else ""))
        return messages

    def _restart(self, t: Tracked) -> str:
        self.launcher.children.pop(t.spec.name, None)
        try:
            self._start(t)
        except ServiceStartError as exc:
            t.quick_deaths += 1
            t.proc = None
            if t.quick_deaths >= GIVE_UP_AFTER:
                raise SupervisionError(f"{t.spec.name} does not start: {exc}") from None
            t.next_start = time.monotonic() + min(BACKOFF_S * 2 ** t.quick_deaths,
                                                  BACKOFF_MAX_S)
            return f"{t.spec.name} failed to start again: {str(exc).splitlines()[0]}"
        t.restarts += 1
        return f"{t.spec.name} restarted (restart {t.restarts})"

    def _log_path(self, t: Tracked) -> Path:
        return self.launcher.runtime_dir / f"{t.spec.name}.log"

    def pids(self) -> dict[str, int]:
        return {name: t.proc.pid for name, t in self.tracked.items() if t.proc is not None}

    def restarts(self) -> dict[str, int]:
        return {name: t.restarts for name, t in self.tracked.items()}

    # --- stopping ---------------------------------------------------------------------------

    def stop(self, timeout_s: float = 10.0) -> None:
        """Everything down, in reverse start order; no process, socket or arena left."""
        from flashmoe.runtime.launch import stop_process

        for t in reversed(list(self.tracked.values())):
            if t.proc is not None:
                stop_process(t.proc, timeout_s)
                t.proc = None
        self.launcher.stop_all(timeout_s)  # any still starting
        for path in self.socket_paths():
            path.unlink(missing_ok=True)
        sweep_stale_arenas()

    def exited(self, service: str) -> int | None:
        """The exit status of a service's current process (None while it runs or restarts)."""
        t = self.tracked[service]
        return t.proc.poll() if t.proc is not None else None
