"""The worker side of the cache manager protocol.

A ``CacheClient`` connects a DEALER socket to the cache manager's ROUTER, does the HELLO/READY
handshake (its config's section digests against the manager's; a mismatch raises
``ConfigMismatch`` naming the sections; a client made without a config is not compared), maps
the arena read-only and turns ``acquire(layer, experts)`` into zero-copy tensor views. Pins are
per layer: ``acquire(layer, experts, release_layers=[...])`` drops the named layers' pins in
the same message. Every wait is bounded: no reply within ``ipc.acquire_timeout_s`` (or a
``Dead`` from the manager, or a closed connection) raises ``CacheManagerUnavailable``; the
client is unusable after that. ZMTP heartbeats (``ipc.heartbeat_*``) keep an idle client alive
in the manager's eyes; a client that stops answering them loses its pins.
"""

from __future__ import annotations

import os
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from common.arena import Arena
from common.bus import HARD_MAX_MESSAGE_BYTES, ConfigMismatch, make_socket
from common.config import FlashMoEConfig
from common.protocol import (AcquireError, AcquireRep, AcquireReq, CacheToWorker, Dead, Decoder,
                             Hello, Message, PrefetchHint, ProtocolError, Ready, Rejected,
                             Release, Released, StatsRep, StatsReq, encode)
from common.store import ExpertStore


PEER_CHECK_MS = 50  # longest a wait goes without looking at the connection's state


class CacheManagerUnavailable(RuntimeError):
    """The cache manager did not answer in time, or said it is dead."""


class ExpertLoadError(RuntimeError):
    """The cache manager could not provide some experts (checksum, IO, unknown expert...)."""

    def __init__(self, code: str, message: str, layer: int, experts: list[int]) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.layer, self.experts = code, layer, experts


class CacheClient:
    def __init__(self, endpoint: str, config: FlashMoEConfig | None = None,
                 name: str = "worker") -> None:
        digests = config.section_digests() if config is not None else {}
        self.config = config or FlashMoEConfig()
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.send_to_cache = make_socket(self.ctx, zmq.DEALER, self.config, linger_ms=0)
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
        self.broken: str | None = None
        self.arena: Arena | None = None
        try:
            self.send_to_cache.send(encode(Hello(name, os.getpid(), digests)))
            ready = self._wait(Ready, None, self.config.ipc.handshake_timeout_s,
                               "ipc.handshake_timeout_s")
            self.ready = ready
            self.engine = ready.engine
            self.store = ExpertStore.open(ready.store_path)
            self.arena = Arena.attach(ready.arena_name, ready.slot_bytes, ready.n_slots)
        except BaseException:
            self.close()
            raise

    def _wait(self, expected: type, seq: int | None, timeout_s: float, setting: str) -> Message:
        if self.broken:
            raise CacheManagerUnavailable(self.broken)
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
            if message.code == "config_mismatch":
                mismatch = ConfigMismatch(message.message.split(","),
                                          f"the cache manager at {self.endpoint}")
                self.broken = str(mismatch)
                raise mismatch
            raise ProtocolError(message.code, message.message)
        if seq is not None and getattr(message, "seq", seq) != seq:
            return None
        if isinstance(message, AcquireError) and expected is AcquireRep:
            raise ExpertLoadError(message.code, message.message, message.layer,
                                  list(message.experts))
        return message if isinstance(message, expected) else None

    def _check_peer_events(self) -> None:
        while self.peer_events.poll(0):
            event = recv_monitor_message(self.peer_events)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected:
                self.broken = f"the cache manager at {self.endpoint} went away (connection closed)"
                raise CacheManagerUnavailable(self.broken)

    def _request(self, message: Message, expected: type, seq: int) -> Message:
        if self.broken:
            raise CacheManagerUnavailable(self.broken)
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

    def acquire(self, layer: int, experts: list[int], release_layers=(), token: str = ""
                ) -> list[int]:
        """Slots holding the layer's experts, pinned until this layer is released (or
        acquired again); ``release_layers`` are dropped first, in the same message.
        ``token``: the decode step's input token, context for the manager's prefetcher; the
        request also carries ``self.step`` (the worker sets it: ``AcquireReq.step``)."""
        self.seq = seq = self.seq + 1
        return self._request(AcquireReq(seq, layer, experts, release_layers, token, self.step),
                             AcquireRep, seq).slots

    def acquire_tensors(self, layer: int, experts: list[int], release_layers=(),
                        token: str = "") -> list[dict]:
        """Zero-copy torch views of each expert's projections, in request order."""
        slots = self.acquire(layer, experts, release_layers, token)
        return [self.arena.torch_views(slot, self.store.expert(layer, expert))
                for expert, slot in zip(experts, slots)]

    def prefetch(self, layer: int, experts: list[int]) -> None:
        """Ask for experts ahead of use; no reply, nobody waits."""
        if self.broken:
            raise CacheManagerUnavailable(self.broken)
        self.send_to_cache.send(encode(PrefetchHint(layer, list(experts))))

    def release(self, layers=None) -> None:
        """Drop the pins of ``layers`` (every layer when None)."""
        seq = self._next_seq()
        self._request(Release(seq, list(layers or [])), Released, seq)

    def stats(self) -> dict:
        seq = self._next_seq()
        return dict(self._request(StatsReq(seq), StatsRep, seq).stats)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        if hasattr(self, "peer_events"):
            self.send_to_cache.disable_monitor()
            self.peer_events.close()
        self.send_to_cache.close()
        self.ctx.term()

    def __enter__(self) -> "CacheClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
