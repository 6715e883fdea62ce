"""The skeleton every FlashMoE service process shares: state, signals, logging, parent death,
a control socket on its own thread, and one loop that polls its sockets and ticks.

A service subclasses ``Service``: it builds its sockets in ``__init__`` (after calling the
base), lists them in ``sockets()``, handles a readable one in ``on_readable(sock)`` and does
periodic work in ``on_tick(now)``. Signals only flip the state; the loop does the work;
state changes happen under ``self.lock`` (which the control thread takes for stats).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import signal
import threading
import time
import traceback
from collections import Counter
from typing import Any, Callable

import zmq

from common.bus import ControlServer
from common.config import FlashMoEConfig

TICK_S = 0.1


class State(enum.Enum):
    RUNNING = "running"
    STOP_REQUESTED = "stopping"
    FAILED = "failed"


def arm_parent_death_signal() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def setup_process_logging() -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")


class Service:
    name = "service"

    def __init__(self, config: FlashMoEConfig, control_endpoint: str) -> None:
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

    def close_sockets(self) -> None:
        for sock in self.sockets():
            sock.close()

    # --- the loop ----------------------------------------------------------------------------

    def request_stop(self, *_args) -> None:
        if self.state is State.RUNNING:
            self.state = State.STOP_REQUESTED

    def run(self) -> None:
        self.control = ControlServer(self.ctx, self.config, self.control_endpoint, self.name,
                                     stats=self.stats, state=lambda: self.state.value,
                                     lock=self.lock, tune=self.tune)
        poller = zmq.Poller()
        for sock in self.sockets():
            poller.register(sock, zmq.POLLIN)
        next_tick = time.monotonic()
        try:
            while self.state is State.RUNNING:
                events = dict(poller.poll(int(TICK_S * 1000)))
                with self.lock:
                    for sock in events:
                        self.on_readable(sock)
                    now = time.monotonic()
                    if now >= next_tick:
                        next_tick = now + TICK_S
                        self.on_tick(now)
        finally:
            self.control.close()
            self.close_sockets()
            self.ctx.term()


def run_service_process(make: Callable[[], Service]) -> int:
    """Process entry of a service: parent-death signal, logging, signals, the loop."""
    arm_parent_death_signal()
    setup_process_logging()
    log = logging.getLogger("flashmoe")
    try:
        service = make()
    except Exception:
        log.error("failed to start:\n%s", traceback.format_exc())
        raise
    signal.signal(signal.SIGTERM, service.request_stop)
    signal.signal(signal.SIGINT, service.request_stop)
    service.log.info("%s running, pid %d", service.name, os.getpid())
    service.run()
    service.log.info("%s stopped after %.1f s", service.name, time.monotonic() - service.started)
    return 0
