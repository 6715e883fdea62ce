"""Socket plumbing shared by every FlashMoE process: the one place for ZeroMQ details.

- ``make_socket``: linger, a hard message-size cap, ZMTP heartbeats (``ipc.heartbeat_*``: a
  peer that stops answering pings is disconnected), ipc socket files in a 0700 runtime folder,
  never taken from a live listener (``EndpointInUse``).
- ``Inbox``: typed receive; a bad frame is counted (``rejected_<code>``) and reported, never
  raised past the loop.
- ``PeerWatch``: which ROUTER peer went away (a closed connection, or missed heartbeats), so a
  service can drop what that peer held.
- ``handshake_mismatch``: the HELLO/READY config check, per section.
- ``SeqGaps``, ``Publisher``, ``Subscriber``: sequence-numbered PUB/SUB with gap counting.
- ``ControlServer`` / ``control_request``: every service's control socket (health, stats, its
  effective config, live tuning), apart from the hot path; health checks never count as
  workers.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping

import zmq
from zmq.utils.monitor import parse_monitor_message

from common.config import (ConfigError, FlashMoEConfig, check_value, differing_sections,
                           field_spec)
from common.protocol import (ConfigRep, ConfigReq, ControlReply, ControlRequest, Dead, Decoder,
                             HealthRep, HealthReq, Message, PoliciesRep, PoliciesReq,
                             ProtocolError, Rejected, ResidencyRep, ResidencyReq, StatsRep,
                             StatsReq, TuneRep, TuneReq, encode)

log = logging.getLogger("flashmoe.bus")

HARD_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # ZeroMQ drops the connection of a larger frame


class ConfigMismatch(RuntimeError):
    """Two peers' configurations differ in fields that cannot change while running."""

    def __init__(self, sections: list[str], peer: str) -> None:
        super().__init__(f"configuration differs from {peer} in section(s) "
                         f"{', '.join(sections)}: start both with the same config (only live "
                         f"fields may differ; `flashmoe config --fields` marks them)")
        self.sections = sections


class ServiceUnavailable(RuntimeError):
    """A service's control socket did not answer in time, or it said it is dead."""


# --- runtime folder and endpoints ------------------------------------------------------------

def make_runtime_dir(config: FlashMoEConfig | None = None) -> Path:
    """``ipc.runtime_dir`` (created, mode 0700) or a fresh private folder under the temp dir."""
    configured = config.ipc.runtime_dir if config is not None else ""
    if not configured:
        return Path(tempfile.mkdtemp(prefix="flashmoe-run-"))
    path = Path(configured)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def ipc_endpoint(runtime_dir: Path, name: str) -> str:
    return f"ipc://{runtime_dir / name}.sock"


def control_endpoint_for(endpoint: str) -> str:
    """The control socket next to a service's main ipc endpoint (``x.sock`` ->
    ``x.control.sock``); tcp endpoints must name theirs."""
    if not endpoint.startswith("ipc://"):
        raise ValueError(f"{endpoint}: give the control endpoint explicitly for non-ipc "
                         f"transports")
    base = endpoint[:-5] if endpoint.endswith(".sock") else endpoint
    return f"{base}.control.sock"


def _ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


class EndpointInUse(OSError):
    """Another live process listens on an ipc endpoint this one was to bind."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(errno.EADDRINUSE, f"{endpoint}: another process is listening on it "
                         f"(a second instance?); stop it or choose another endpoint")
        self.endpoint = endpoint


def claim_ipc_path(path: Path, endpoint: str) -> None:
    """Remove ``path`` before binding only if it is stale: a socket file nothing answers on
    (a dead process's). A live listener raises EndpointInUse; the file is left alone."""
    if not os.path.lexists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(os.fspath(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise EndpointInUse(endpoint)


def make_socket(ctx: zmq.Context, kind: int, config: FlashMoEConfig, *, bind: str | None = None,
                connect: str | None = None, linger_ms: int = 1000,
                options: Mapping[int, int] | None = None) -> zmq.Socket:
    """A socket with FlashMoE's options (and ``options``, set before bind/connect); ``bind``
    makes the ipc folder (0700) first and takes over an ipc socket file only if nothing
    answers on it (``claim_ipc_path``: EndpointInUse otherwise). ROUTER/PUB keep
    ``linger_ms`` so a last ``Dead`` still goes out."""
    sock = ctx.socket(kind)
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, HARD_MAX_MESSAGE_BYTES)
    ivl_ms = int(config.ipc.heartbeat_interval_s * 1000)
    timeout_ms = int(config.ipc.heartbeat_timeout_s * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)
    try:
        if bind:
            path = _ipc_path(bind)
            if path is not None:
                if not path.parent.exists():
                    path.parent.mkdir(mode=0o700, parents=True)
                claim_ipc_path(path, bind)  # a socket file left by a dead process goes
            sock.bind(bind)
            if path is not None:
                os.chmod(path, 0o600)
        if connect:
            sock.connect(connect)
    except (zmq.ZMQError, OSError):
        sock.close(0)
        raise
    return sock


# --- typed receive -----------------------------------------------------------------------------

class Inbox:
    """Decode frames of one socket into its message union; bad frames are counted in
    ``counters["rejected_<code>"]`` and returned as the ProtocolError (never raised)."""

    def __init__(self, union, max_bytes: int, counters: Counter, name: str) -> None:
        self.decoder = Decoder(union, max_bytes=max_bytes)
        self.counters = counters
        self.name = name

    def decode(self, frame: bytes | memoryview) -> Message | ProtocolError:
        try:
            return self.decoder.decode(frame)
        except ProtocolError as exc:
            self.counters[f"rejected_{exc.code}"] += 1
            log.warning("%s: rejected a message: %s", self.name, exc)
            return exc


def handshake_mismatch(mine: Mapping[str, str], theirs: Mapping[str, str],
                       sections: tuple[str, ...]) -> list[str]:
    """Sections (of ``sections``) whose digests differ; a side without digests ({}) is not
    compared (a bare client such as a benchmark or a health probe)."""
    if not mine or not theirs:
        return []
    return differing_sections(mine, theirs, sections)


# --- who went away -----------------------------------------------------------------------------

class PeerWatch:
    """Tell which peers of a ROUTER disconnected (closed socket, or missed ZMTP heartbeats).

    ZeroMQ's monitor reports a disconnect by file descriptor; a peer's descriptor is read
    from its first message (``remember``). Drain ``socket`` before the ROUTER itself in each
    loop turn: the kernel may hand a closed descriptor's number to a new peer, and the
    monitor reports the old one's disconnect before that can happen.
    """

    def __init__(self, router: zmq.Socket) -> None:
        self.socket = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._router = router
        self._by_fd: dict[int, bytes] = {}

    def remember(self, identity: bytes, frame: zmq.Frame) -> None:
        fd = frame.get(zmq.SRCFD)
        for old_fd, old_identity in list(self._by_fd.items()):
            if old_identity == identity:
                del self._by_fd[old_fd]
        self._by_fd[fd] = identity

    def disconnected(self) -> list[bytes]:
        gone = []
        while self.socket.poll(0):
            event = parse_monitor_message(self.socket.recv_multipart())
            identity = self._by_fd.pop(event["value"], None)
            if identity is not None:
                gone.append(identity)
        return gone

    def close(self) -> None:
        self._router.disable_monitor()
        self.socket.close(0)


# --- PUB/SUB with sequence numbers -------------------------------------------------------------

class SeqGaps:
    """Per-source sequence accounting for a subscriber: ``n_gap`` counts messages lost
    (skipped sequence numbers), ``n_out_of_order`` ones that came late or twice. A source
    that restarts (sequence back to 0, or a new epoch) starts afresh."""

    def __init__(self, counters: Counter) -> None:
        self.counters = counters
        self._last: dict[Any, tuple[Any, int]] = {}

    def observe(self, source: Any, seq: int, epoch: Any = None) -> int:
        """Record one message; returns how many were missed just before it."""
        self.counters["n_received"] += 1
        last = self._last.get(source)
        if last is None or last[0] != epoch:
            self._last[source] = (epoch, seq)
            return 0
        expected = last[1] + 1
        if seq < expected:
            self.counters["n_out_of_order"] += 1
            return 0
        self._last[source] = (epoch, seq)
        missed = seq - expected
        self.counters["n_gap"] += missed
        return missed


class Publisher:
    """A PUB socket; ``publish`` sends one encoded message (the message carries its own
    sequence number and epoch, see the bus messages in common/protocol.py)."""

    def __init__(self, ctx: zmq.Context, config: FlashMoEConfig, endpoint: str,
                 hwm: int = 100_000) -> None:
        self.socket = make_socket(ctx, zmq.PUB, config, bind=endpoint,
                                  options={zmq.SNDHWM: hwm})

    def publish(self, message: Message) -> None:
        self.socket.send(encode(message), copy=False)

    def close(self) -> None:
        self.socket.close()


class Subscriber:
    """A SUB socket on one or more publishers, all topics, with a typed inbox."""

    def __init__(self, ctx: zmq.Context, config: FlashMoEConfig, endpoints: list[str], union,
                 counters: Counter, name: str, hwm: int = 100_000) -> None:
        self.socket = make_socket(ctx, zmq.SUB, config, linger_ms=0,
                                  options={zmq.RCVHWM: hwm})
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        for endpoint in endpoints:
            self.socket.connect(endpoint)
        self.inbox = Inbox(union, HARD_MAX_MESSAGE_BYTES, counters, name)

    def drain(self, limit: int = 10_000) -> list[Message]:
        out = []
        for _ in range(limit):
            try:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            message = self.inbox.decode(frame.buffer)
            if not isinstance(message, ProtocolError):
                out.append(message)
        return out

    def close(self) -> None:
        self.socket.close(0)


# --- control socket ----------------------------------------------------------------------------

# ``tune(changes, check)``: a service's live-tuning hook. ``changes`` maps "section.field" to
# values already checked against common/config.py (live fields only); it returns the keys the
# service uses live (applied, unless ``check``) and {key: reason} for those it uses but cannot
# take now. Keys in neither are not read by that service.
TuneHook = Callable[[dict[str, Any], bool], tuple[list[str], dict[str, str]]]


class ControlServer:
    """A service's control socket (ROUTER), served on a thread of its own, apart from the
    hot path: health, stats, the service's effective config and live tuning (``tune``; a
    service without the hook answers that it takes no live change). Handlers run under
    ``lock``, which the service's loop holds while it changes its state, so a snapshot is
    consistent and the loop never waits on a control client. Its peers are never workers.

    ``config`` is the service's own config object: a tuning change the service applied is
    written into it, so that ``ConfigReq`` answers what the service runs with."""

    def __init__(self, ctx: zmq.Context, config: FlashMoEConfig, endpoint: str, service: str,
                 stats: Callable[[], dict], state: Callable[[], str], lock: threading.Lock,
                 extra: Mapping[type, Callable[[Message], Message]] | None = None,
                 tune: TuneHook | None = None) -> None:
        self.endpoint = endpoint
        self.service = service
        self.config = config
        self._tune = tune
        self.counters: Counter = Counter()
        self.inbox = Inbox(ControlRequest, config.ipc.max_message_bytes, self.counters,
                           f"{service} control")
        self._stats, self._state, self._lock = stats, state, lock
        self._extra = dict(extra or {})
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(ctx, config),
                                        name=f"{service}-control", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._error is not None:
            raise self._error

    def _run(self, ctx: zmq.Context, config: FlashMoEConfig) -> None:
        try:
            sock = make_socket(ctx, zmq.ROUTER, config, bind=self.endpoint)
        except BaseException as exc:  # reported to the constructor
            self._error = exc
            self._bound.set()
            return
        self._bound.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    self._serve(sock)
        finally:
            sock.close()

    def _serve(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = frames[0]
            if len(frames) != 2:
                self.counters["rejected_malformed"] += 1
                reply = Rejected("malformed", f"{len(frames) - 1} frames")
            else:
                try:
                    reply = self._answer(self.inbox.decode(frames[1]))
                except Exception as exc:  # a handler's bug must not end the control socket
                    log.exception("%s control: a request failed", self.service)
                    self.counters["errors"] += 1
                    reply = Rejected("internal", f"{type(exc).__name__}: {exc}"[:4000])
            if reply is not None:
                try:
                    sock.send_multipart([identity, encode(reply)], zmq.NOBLOCK)
                except zmq.Again:
                    log.warning("%s control: dropped a reply, the peer's queue is full",
                                self.service)

    def _answer(self, message: Message | ProtocolError) -> Message | None:
        if isinstance(message, ProtocolError):
            return Rejected(message.code, str(message)[:4000])
        if isinstance(message, HealthReq):
            own = self._extra.get(HealthReq)  # a service's own health check, if it has one
            if own is not None:
                return own(message)
            return HealthRep(message.seq, self.service, os.getpid(), self._state(),
                             round(time.monotonic() - self._started, 3))
        with self._lock:
            if isinstance(message, StatsReq):
                return StatsRep(message.seq, self._stats())
            if isinstance(message, ConfigReq):
                return ConfigRep(message.seq, self.config.to_dict())
            if isinstance(message, TuneReq):
                return self._answer_tune(message)
            handler = self._extra.get(type(message))
            if handler is None:
                return Rejected("unsupported", f"{self.service} does not answer "
                                               f"{type(message).__name__}")
            return handler(message)

    def _answer_tune(self, message: TuneReq) -> TuneRep:
        """Check every change again (the sender is a peer, not a validator), hand the live
        ones to the service's hook, and write what it applied into its config."""
        valid, refused = {}, {}
        for key, value in message.changes.items():
            try:
                checked = check_value(key, value, f"a tuning request to {self.service}")
                spec = field_spec(*key.split(".", 1))[1]
            except ConfigError as exc:
                refused[key] = str(exc)
                continue
            if not spec["live"]:
                why = spec["fixed_because"] or "restart the services to change it"
                refused[key] = f"{key} is not live: {why}"
                continue
            valid[key] = checked
        if self._tune is None:
            return TuneRep(message.seq, False, [], refused)
        applied, hook_refused = self._tune(valid, message.check)
        refused.update(hook_refused)
        if not message.check:
            for key in applied:
                section, name = key.split(".", 1)
                setattr(getattr(self.config, section), name, valid[key])
            if applied:
                log.info("%s: tuned %s", self.service,
                         ", ".join(f"{key}={valid[key]!r}" for key in applied))
        return TuneRep(message.seq, True, list(applied), refused)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def control_request(endpoint: str, message: Message, timeout_s: float = 5.0) -> Message:
    """One request on a service's control socket; raises ServiceUnavailable on no answer or
    a ``Dead``."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode(message))
        if not sock.poll(int(timeout_s * 1000)):
            raise ServiceUnavailable(f"no answer on the control socket {endpoint} within "
                                     f"{timeout_s:g} s")
        try:
            reply = Decoder(ControlReply, max_bytes=HARD_MAX_MESSAGE_BYTES).decode(sock.recv())
        except ProtocolError as exc:
            raise ServiceUnavailable(f"{endpoint} answered with a bad message: {exc}") from None
        if isinstance(reply, Dead):
            raise ServiceUnavailable(f"{endpoint}: service is dead: {reply.reason}")
        return reply
    finally:
        sock.close(0)


def health(endpoint: str, timeout_s: float = 5.0) -> HealthRep:
    reply = control_request(endpoint, HealthReq(0), timeout_s)
    if not isinstance(reply, HealthRep):
        raise ServiceUnavailable(f"{endpoint}: unexpected answer {reply!r}")
    return reply


def stats(endpoint: str, timeout_s: float = 5.0) -> dict:
    reply = control_request(endpoint, StatsReq(0), timeout_s)
    if not isinstance(reply, StatsRep):
        raise ServiceUnavailable(f"{endpoint}: unexpected answer {reply!r}")
    return dict(reply.stats)


def service_config(endpoint: str, timeout_s: float = 5.0) -> dict:
    """The effective config a running service uses (live changes included), as a dict."""
    reply = control_request(endpoint, ConfigReq(0), timeout_s)
    if not isinstance(reply, ConfigRep):
        raise ServiceUnavailable(f"{endpoint}: unexpected answer {reply!r}")
    return dict(reply.config)


def tune(endpoint: str, changes: Mapping[str, Any], check: bool = False,
         timeout_s: float = 5.0) -> TuneRep:
    """Ask a running service to take live config changes (``check``: only ask whether it
    would)."""
    # A table (cache.policy_params) travels as JSON text; the service coerces it back.
    wire = {key: json.dumps(value) if isinstance(value, dict) else value
            for key, value in changes.items()}
    reply = control_request(endpoint, TuneReq(0, wire, check), timeout_s)
    if not isinstance(reply, TuneRep):
        raise ServiceUnavailable(f"{endpoint}: unexpected answer {reply!r}")
    return reply


def residency(endpoint: str, timeout_s: float = 5.0) -> ResidencyRep:
    """Which experts are resident and how often each was asked for (a cache manager that
    answers ``ResidencyReq``); ServiceUnavailable when it does not."""
    reply = control_request(endpoint, ResidencyReq(0), timeout_s)
    if not isinstance(reply, ResidencyRep):
        raise ServiceUnavailable(f"{endpoint}: {getattr(reply, 'message', repr(reply))}")
    return reply


def policies(endpoint: str, timeout_s: float = 5.0) -> PoliciesRep:
    """The eviction policies a cache manager can run live (one that answers ``PoliciesReq``);
    ServiceUnavailable when it does not."""
    reply = control_request(endpoint, PoliciesReq(0), timeout_s)
    if not isinstance(reply, PoliciesRep):
        raise ServiceUnavailable(f"{endpoint}: {getattr(reply, 'message', repr(reply))}")
    return reply
