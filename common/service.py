"""The skeleton every FlashMoE service process shares: state, signals, logging, parent death,
a control socket on its own thread (health, stats, config, live tuning), one loop, and the
exit status.

A service subclasses ``Service``: it builds its sockets in ``__init__`` (after calling the
base), lists them in ``sockets()``, handles a readable one in ``on_readable(sock)`` and does
periodic work in ``on_tick(now)``. A service whose loop is not a plain poll (the cache
manager's waits on the disk too; a client replays its work) overrides ``serve()`` and checks
``self.state`` as it goes. Signals only flip the state; the loop does the work; state changes
happen under ``self.lock`` (which the control thread takes for stats and tuning).

The hooks around the loop: ``control_handlers()`` (requests the control socket answers beyond
health, stats, config and tuning), ``banner()`` (the start line), ``on_exit(error)`` (the
last word to peers, e.g. a ``Dead`` sentinel), ``close_sockets()`` (before the ZeroMQ context
ends) and ``close_resources()`` (files, threads and memory, after it). A service that cannot
go on raises ``ServiceFailed``: the process exits with its ``exit_code`` so that a supervisor
restarts it. A service given no control endpoint has no control socket (a client of the
others', such as the panel and the worker).

While a service is being built (``make()``), and wherever it waits in ``interruptible()`` (a
handshake with a peer that may never come), SIGTERM and SIGINT raise ``Interrupted`` instead
of flipping the state, so that the clean-up of what is half made runs (``try``/``finally``,
``except BaseException``) and the process ends at once; in the loop they only flip the state.
The parent-death signal is armed first thing; a process whose parent (``PARENT_PID_ENV``, set
by the launcher) died before that exits at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import signal
import threading
import time
import traceback
from collections import Counter
from typing import Any, Callable, Mapping

import zmq

from common.bus import ControlServer
from common.config import FlashMoEConfig
from common.protocol import Message

TICK_S = 0.1
PARENT_PID_ENV = "FMOE_PARENT_PID"  # the launcher's pid (not FLASHMOE_*: those are config)


class State(enum.Enum):
    RUNNING = "running"
    STOP_REQUESTED = "stopping"
    FAILED = "failed"


class ServiceFailed(RuntimeError):
    """The service cannot go on (or cannot start): the process exits with ``exit_code``.
    ``what`` names the failure in the exit line."""

    exit_code = 1
    what = "a failure"


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived while a process was setting up (or waiting in
    ``interruptible``): a BaseException, so that the usual ``except Exception`` lets it pass
    and only clean-up code sees it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_interrupted(signum, _frame) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def raising_signals(stop_requested: Callable[[], bool] = lambda: False):
    """SIGTERM and SIGINT raise ``Interrupted`` inside the block (the main thread's handlers;
    elsewhere a no-op); the previous handlers come back after it. A stop already requested
    (``stop_requested()``) raises at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_interrupted)
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if stop_requested():
            raise Interrupted(signal.SIGTERM)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def arm_parent_death_signal() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux only). A parent
    named in ``PARENT_PID_ENV`` that is already gone (it died before this was armed) ends
    this process at once with ``Interrupted``. The variable is consumed: children of this
    process do not inherit it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is not None and parent.isdigit() and os.getppid() != int(parent):
        raise Interrupted(signal.SIGTERM)


def setup_process_logging() -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")


class Service:
    name = "service"

    def __init__(self, config: FlashMoEConfig, control_endpoint: str | None) -> None:
        self.config = config
        self.log = logging.getLogger(f"flashmoe.{self.name}")
        self.ctx = zmq.Context()
        self.state = State.RUNNING
        self.lock = threading.Lock()
        self.counters: Counter = Counter()
        self.started = time.monotonic()
        self.control_endpoint = control_endpoint
        self.control: ControlServer | None = None  # started by run(), once fully built

    # --- what a service provides -------------------------------------------------------------

    def sockets(self) -> list[zmq.Socket]:
        return []

    def on_readable(self, sock: zmq.Socket) -> None:
        """A socket of ``sockets()`` has messages."""

    def on_tick(self, now: float) -> None:
        """About every ``TICK_S`` seconds."""

    def stats(self) -> dict:
        return {**self.counters, "state": self.state.value, "pid": os.getpid(),
                "uptime_s": round(time.monotonic() - self.started, 3)}

    def tune(self, changes: dict[str, Any], check: bool) -> tuple[list[str], dict[str, str]]:
        """Live config changes (``section.field`` -> a value checked against common/config.py,
        live fields only), on the control thread under ``self.lock``: returns the keys this
        service uses (applied unless ``check``) and {key: reason} for those it cannot take
        now; keys it does not read are left out of both. The control server then writes the
        applied values into ``self.config``. The base service reads no live field."""
        return [], {}

    def control_handlers(self) -> Mapping[type, Callable[[Message], Message]]:
        """Control requests this service answers beyond health, stats, config and tuning."""
        return {}

    def banner(self) -> str:
        """The line logged once the service runs (the pid follows)."""
        return f"{self.name} running"

    def on_exit(self, error: Exception | None) -> None:
        """The loop ended: cleanly (``error`` None) or with ``error`` (then raised on)."""

    def close_sockets(self) -> None:
        for sock in self.sockets():
            sock.close()

    def close_resources(self) -> None:
        """What outlives the sockets (engines, threads, shared memory), after the context."""

    # --- the loop ----------------------------------------------------------------------------

    def request_stop(self, *_args) -> None:
        if self.state is State.RUNNING:
            self.state = State.STOP_REQUESTED

    def interruptible(self):
        """A block (a handshake, a reconnection) that SIGTERM/SIGINT end at once with
        ``Interrupted`` rather than after its own timeout; a stop already requested raises
        on entry."""
        return raising_signals(lambda: self.state is not State.RUNNING)

    def serve(self) -> None:
        """Poll ``sockets()`` and tick until stopped."""
        poller = zmq.Poller()
        for sock in self.sockets():
            poller.register(sock, zmq.POLLIN)
        next_tick = time.monotonic()
        has_sockets = bool(self.sockets())
        while self.state is State.RUNNING:
            if has_sockets:
                events = dict(poller.poll(int(TICK_S * 1000)))
            else:  # zmq_poll over no socket returns at once: sleep the tick instead
                time.sleep(TICK_S)
                events = {}
            with self.lock:
                for sock in events:
                    self.on_readable(sock)
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK_S
                    self.on_tick(now)

    def run(self) -> None:
        if self.control_endpoint is not None:
            self.control = ControlServer(self.ctx, self.config, self.control_endpoint, self.name,
                                         stats=self.stats, state=lambda: self.state.value,
                                         lock=self.lock, tune=self.tune,
                                         extra=self.control_handlers())
        try:
            self.serve()
            self.on_exit(None)
        except Exception as exc:
            self.on_exit(exc)
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Control socket, sockets, context, then resources (what ``run`` ends with)."""
        if self.control is not None:
            self.control.close()
        self.close_sockets()
        self.ctx.term()
        self.close_resources()


def run_service_process(make: Callable[[], Service], name: str = "service") -> int:
    """Process entry of a service: parent-death signal, logging, signals, the loop; returns
    the exit status (``ServiceFailed.exit_code`` when it failed, else 0). A stop during set-up
    (SIGTERM/SIGINT raise ``Interrupted`` while ``make()`` runs, so the half-made service's
    own clean-up runs) or in an ``interruptible`` wait is one log line and status 0."""
    setup_process_logging()
    log = logging.getLogger(f"flashmoe.{name}")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_interrupted)
    service = None
    try:
        arm_parent_death_signal()
        service = make()
        # from here on a signal only flips the state: the loop ends, the hooks clean up
        signal.signal(signal.SIGTERM, service.request_stop)
        signal.signal(signal.SIGINT, service.request_stop)
    except Interrupted as exc:
        if service is not None:  # built, but stopped before its loop: closed as after it
            service.close()
        log.info("%s %s while starting", name, exc)
        return 0
    except ServiceFailed as exc:
        log.error("%s", exc)
        return exc.exit_code
    except Exception:
        log.error("%s failed to start:\n%s", name, traceback.format_exc())
        raise
    service.log.info("%s, pid %d", service.banner(), os.getpid())
    try:
        service.run()
    except Interrupted as exc:
        service.log.info("%s %s", service.name, exc)
        return 0
    except ServiceFailed as exc:
        service.log.error("exiting after %s: %s", exc.what, exc)
        return exc.exit_code
    service.log.info("%s stopped after %.1f s", service.name, time.monotonic() - service.started)
    return 0
