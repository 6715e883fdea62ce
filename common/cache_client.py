"""The worker side of the cache manager protocol.

A ``CacheClient`` connects a DEALER socket to the cache manager's ROUTER, does the HELLO/READY
handshake (its config's section digests against the manager's; a mismatch raises
``ConfigMismatch`` naming the sections; a client made without a config is not compared), maps
the arena read-only and turns ``acquire(layer, experts)`` into zero-copy tensor views. Pins are
per layer: ``acquire(layer, experts, release_layers=[...])`` drops the named layers' pins in
the same message. Every wait is bounded: no reply within ``ipc.acquire_timeout_s`` (or a
``Dead`` from the manager, or a closed connection) raises ``CacheManagerUnavailable``; the
client is unusable after that. ZMTP heartbeats (``ipc.heartbeat_*``) keep an idle client alive
in the manager's eyes; a client that stops answering them (a frozen process: SIGSTOP, ``docker
pause``) loses its pins.

The errors a caller sees (never a raw ``ProtocolError``):
  - ``CacheManagerUnavailable``: no reply in time, ``Dead``, a closed connection, a message the
    client cannot read. The client is unusable: make a new ``CacheClient`` (a new handshake)
    and redo the step.
  - ``PinsLost`` (a ``CacheManagerUnavailable``): the manager dropped this client (missed
    heartbeats) or the connection closed; the slots it was given may now hold other experts.
    A step computed since its last reply must be redone with a new client. ``lost()`` tells
    it exactly and cheaply (no round trip: the arena's per-slot load counts) before a step's
    result is used.
  - ``ExpertLoadError``: one acquire failed (a checksum or IO error, or a request the model
    does not fit: unknown layer or expert); that acquire only, the client stays usable.
  - ``RequestRefused``: the manager refused a release of a layer the model lacks; the client
    stays usable.
  - ``ShapeMismatch`` (a ``ConfigMismatch``): the ``shape`` given does not match the store the
    manager serves; raised by the constructor.
  - ``ArenaUnreachable`` (a ``CacheManagerUnavailable``): the manager answered the handshake
    but its arena is not in this process's /dev/shm, so no new client of this process can
    work: a container joined to the shared memory of a cache manager that has restarted
    since, or the file was removed. Raised by the constructor; the process must be started
    again next to its manager.

The DEALER's routing id is chosen here (random), so the same client is recognised when its
connection comes back after a freeze and is told ``pins_lost`` instead of ``unexpected``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from common.arena import Arena, ArenaLayout
from common.bus import HARD_MAX_MESSAGE_BYTES, ConfigMismatch, make_socket
from common.config import FlashMoEConfig
from common.protocol import (AcquireError, AcquireRep, AcquireReq, CacheToWorker, Dead, Decoder,
                             Hello, Message, PrefetchHint, ProtocolError, Ready, Rejected,
                             Release, Released, StatsRep, StatsReq, encode)
from common.store import ExpertEntry, ExpertStore


PEER_CHECK_MS = 50  # longest a wait goes without looking at the connection's state


class CacheManagerUnavailable(RuntimeError):
    """The cache manager did not answer in time, or said it is dead: make a new client."""


class PinsLost(CacheManagerUnavailable):
    """The manager dropped this client (missed heartbeats) or its connection closed: its pins
    are gone and its slots may hold other experts. Make a new client and redo the step."""


class ArenaUnreachable(CacheManagerUnavailable):
    """The manager's arena file is not in this process's /dev/shm (see the module's text)."""


class ShapeMismatch(ConfigMismatch):
    """The model shape a client expects differs from the store the manager serves."""

    def __init__(self, message: str) -> None:
        RuntimeError.__init__(self, message)
        self.sections = ["shape"]


class RequestRefused(ValueError):
    """The manager refused one request that does not fit the model (``code``); nothing
    changed and the client stays usable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class ExpertLoadError(RuntimeError):
    """The cache manager could not provide some experts (checksum, IO, unknown expert...)."""

    def __init__(self, code: str, message: str, layer: int, experts: list[int]) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.layer, self.experts = code, layer, experts


class CacheClient:
    def __init__(self, endpoint: str, config: FlashMoEConfig | None = None,
                 name: str = "worker", shape: dict | None = None) -> None:
        """``shape``: ``{"layers", "experts", "top_k", "expert_bytes"}`` the worker expects
        (a key absent or 0 is not compared); a store of another shape raises ShapeMismatch."""
        digests = config.section_digests() if config is not None else {}
        self.config = config or FlashMoEConfig()
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        # A routing id of our own (never starting with a zero byte, which ZeroMQ reserves).
        self.send_to_cache = make_socket(self.ctx, zmq.DEALER, self.config, linger_ms=0,
                                         options={zmq.ROUTING_ID: b"w" + os.urandom(15)})
        self.send_to_cache.connect(endpoint)
        # A dead manager closes the ipc connection: fail at once instead of at the timeout.
        self.peer_events = self.send_to_cache.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.connected = False
        self.decoder = Decoder(CacheToWorker, max_bytes=HARD_MAX_MESSAGE_BYTES)
        self.seq = 0
        # The decode step being served, as the seq of the AccessEvent this worker publishes
        # for it (-1: none); the worker sets it before each step's acquires.
        self.step = -1
        self.broken: str | None = None  # why the client is unusable
        self.broken_as: type[Exception] = CacheManagerUnavailable  # raised again on each call
        # layer -> (its slots, their load counts when acquired): what lost() checks
        self.held: dict[int, tuple[list[int], list[int]]] = {}
        self.arena: Arena | None = None
        try:
            self.send_to_cache.send(encode(Hello(name, os.getpid(), digests,
                                                 {k: int(v) for k, v in (shape or {}).items()})))
            ready = self._wait(Ready, None, self.config.ipc.handshake_timeout_s,
                               "ipc.handshake_timeout_s")
            self.ready = ready
            self.engine = ready.engine
            self.store = ExpertStore.open(ready.store_path)
            try:
                self.arena = Arena.attach(ready.arena_name, ready.slot_bytes, ready.n_slots)
                self.arena.layout = ArenaLayout.from_wire(ready.slot_bytes, ready.n_slots,
                                                          ready.pools)
                for pool in self.arena.layout.pools:
                    self.store.at(pool.precision)  # StoreError: the copy is not here
            except FileNotFoundError:
                raise ArenaUnreachable(
                    f"the cache manager's arena {ready.arena_name} is not in this process's "
                    f"/dev/shm: it does not share the manager's shared memory (a container "
                    f"joined to the IPC namespace of a cache manager that has restarted "
                    f"since, or the file was removed); start this worker again") from None
        except BaseException:
            self.close()
            raise

    def _wait(self, expected: type, seq: int | None, timeout_s: float, setting: str) -> Message:
        if self.broken:
            raise self.broken_as(self.broken)
        deadline = time.monotonic() + timeout_s
        sock = self.send_to_cache
        while True:
            # One socket on the fast path; the connection monitor between slices of the wait,
            # so a dead manager is noticed within a slice.
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(min(left_ms, PEER_CHECK_MS)):
                self._check_peer_events()
                if time.monotonic() < deadline:
                    continue
                self.broken = (f"no reply from the cache manager at {self.endpoint} within "
                               f"{timeout_s:g} s (raise {setting} if it is just slow)")
                raise CacheManagerUnavailable(self.broken)
            message = self._accept(expected, seq)
            if message is not None:
                return message

    def _accept(self, expected: type, seq: int | None) -> Message | None:
        """Receive one message: the awaited reply, None for one to skip (a late answer to a
        request that timed out), or a typed error."""
        try:
            message = self.decoder.decode(self.send_to_cache.recv())
        except ProtocolError as exc:
            self.broken = f"cache manager sent a bad message: {exc}"
            raise CacheManagerUnavailable(self.broken) from None
        if type(message) is expected and getattr(message, "seq", seq) == seq:
            return message  # the common case, first
        if isinstance(message, Dead):
            self.broken = f"cache manager is dead: {message.reason}"
            raise CacheManagerUnavailable(self.broken)
        if isinstance(message, Rejected):
            self._rejected(message)
        if seq is not None and getattr(message, "seq", seq) != seq:
            return None
        if isinstance(message, AcquireError) and expected is AcquireRep:
            raise ExpertLoadError(message.code, message.message, message.layer,
                                  list(message.experts))
        return message if isinstance(message, expected) else None

    def _rejected(self, message: Rejected) -> None:
        """A ``Rejected`` as the typed error it stands for."""
        code, text = message.code, message.message
        if code == "config_mismatch":
            error = ConfigMismatch(text.split(","), f"the cache manager at {self.endpoint}")
        elif code == "shape_mismatch":
            error = ShapeMismatch(f"the cache manager at {self.endpoint}: {text}")
        elif code == "unknown_layer":
            raise RequestRefused(code, text)
        elif code in ("pins_lost", "unexpected"):
            # unexpected: a manager that does not know this client (a restarted one).
            error = PinsLost(f"the cache manager at {self.endpoint} dropped this client "
                             f"({code}: {text}); its pins are lost: make a new CacheClient "
                             f"and redo the step")
        else:
            error = CacheManagerUnavailable(f"the cache manager at {self.endpoint} refused a "
                                            f"request ({code}: {text})")
        self.broken = str(error)
        if isinstance(error, CacheManagerUnavailable):
            self.broken_as = type(error)
        raise error

    def lost(self) -> bool:
        """Whether a slot this client holds was given to another expert since it was acquired
        (the manager dropped this client and reused it), the connection closed, or an error
        made the client unusable: local, no round trip (the arena's per-slot load counts).
        A worker checks it after computing on acquired slots and before using the result;
        when it is True, the result may be wrong: make a new client and redo the step."""
        if self.broken:
            return True
        generations = self.arena.generations
        for slots, seen in self.held.values():
            for slot, count in zip(slots, seen):
                if generations[slot] != count:
                    self.broken = (f"slot {slot} was reloaded while this client held it (the "
                                   f"cache manager at {self.endpoint} dropped this client)")
                    self.broken_as = PinsLost
                    return True
        try:
            self._check_peer_events()
        except CacheManagerUnavailable:
            return True
        return False

    def _check_peer_events(self) -> None:
        while self.peer_events.poll(0):
            event = recv_monitor_message(self.peer_events)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.broken = (f"the cache manager at {self.endpoint} went away or dropped this "
                               f"client (connection closed); its pins are lost: make a new "
                               f"CacheClient and redo the step")
                self.broken_as = PinsLost
                raise PinsLost(self.broken)

    def _request(self, message: Message, expected: type, seq: int) -> Message:
        if self.broken:
            raise self.broken_as(self.broken)
        sock = self.send_to_cache
        sock.send(encode(message))
        if sock.poll(PEER_CHECK_MS):  # the usual case: the answer within the first slice
            reply = self._accept(expected, seq)
            if reply is not None:
                return reply
        return self._wait(expected, seq, self.config.ipc.acquire_timeout_s,
                          "ipc.acquire_timeout_s")

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def acquire(self, layer: int, experts: list[int], release_layers=(), token: str = "",
                weights: Sequence[float] = ()) -> list[int]:
        """Slots holding the layer's experts, pinned until this layer is released (or
        acquired again); ``release_layers`` are dropped first, in the same message.
        ``token``: the decode step's input token, context for the manager's prefetcher; the
        request also carries ``self.step`` (the worker sets it: ``AcquireReq.step``).
        ``weights``: the router's weight of each expert (``AcquireReq.weights``), or none."""
        self.seq = seq = self.seq + 1
        held = self.held
        for released in release_layers:
            held.pop(released, None)
        held.pop(layer, None)  # (a failed acquire leaves the layer unpinned)
        slots = self._request(AcquireReq(seq, layer, experts, release_layers, token, self.step,
                                         [float(w) for w in weights]), AcquireRep, seq).slots
        generations = self.arena.generations
        held[layer] = (slots, [generations[slot] for slot in slots])
        return slots

    def acquire_tensors(self, layer: int, experts: list[int], release_layers=(),
                        token: str = "") -> list[dict]:
        """Zero-copy torch views of each expert's projections, in request order."""
        slots = self.acquire(layer, experts, release_layers, token)
        return [self.arena.torch_views(slot, self.expert_entry(layer, expert, slot)[1])
                for expert, slot in zip(experts, slots)]

    def expert_entry(self, layer: int, expert: int, slot: int) -> tuple[str, ExpertEntry]:
        """(the precision of ``slot``, the expert's layout at that precision)."""
        precision = self.arena.layout.pool_of(slot).precision
        return precision, self.store.at(precision).expert(layer, expert)

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Ask for experts ahead of use; no reply, nobody waits."""
        if self.broken:
            raise self.broken_as(self.broken)
        self.send_to_cache.send(encode(PrefetchHint(layer, list(experts))))

    def release(self, layers=None) -> None:
        """Drop the pins of ``layers`` (every layer when None)."""
        seq = self._next_seq()
        self._request(Release(seq, list(layers or [])), Released, seq)
        if layers:
            for layer in layers:
                self.held.pop(layer, None)
        else:
            self.held.clear()

    def stats(self) -> dict:
        seq = self._next_seq()
        return dict(self._request(StatsReq(seq), StatsRep, seq).stats)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if getattr(self, "store", None) is not None:
            self.store.close()  # its lock's fd (the manifest stays readable)
        if hasattr(self, "peer_events"):
            self.send_to_cache.disable_monitor()
            self.peer_events.close()
        self.send_to_cache.close()
        self.ctx.term()

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
