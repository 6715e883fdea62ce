"""Well-formed worker messages with hostile values sent to a real cache manager.

A real process over a real ipc socket, one for the module: the messages go through everything
a hostile peer meets (decode, dispatch, the core, the IO engine, the reply path), and the
manager's life is observed from outside (a crash or a hang shows as a missing reply). Driving
the CacheManager object through ``dispatch`` would be faster, but its replies go to the
ROUTER and its Hello reads the connection's file descriptor, so the socket would have to be
stubbed; at a few milliseconds a round trip the real process fits the CI profile.

Every AcquireReq gets an AcquireRep or a typed AcquireError (its seq echoed), every Release a
Released or a typed Rejected, every PrefetchHint is counted; afterwards a normal client's
acquire still works and the gauges are consistent.
"""

import os

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from common.cache_client import CacheClient
from common.protocol import (AcquireError, AcquireRep, AcquireReq, CacheToWorker, Decoder, Hello,
                             PrefetchHint, Rejected, Release, Released, StatsRep, StatsReq,
                             encode)
from tests.support.manager import ManagerHandle

REPLY_WAIT_MS = 10_000  # a reply later than this counts as a hang
ACQUIRE_CODES = {"unknown_layer", "unknown_expert", "duplicate_expert", "too_many_experts",
                 "bad_weights", "no_free_slot", "checksum", "io_error"}
U64 = 2**64 - 1


@pytest.fixture(scope="module", params=["lru", "flashmoe"])
def manager(request, tiny_store, tmp_path_factory):
    """One manager per policy: flashmoe is layer-aware (it reads each request's layer and step)."""
    runtime = tmp_path_factory.mktemp("hostile")
    handle = ManagerHandle(tiny_store, runtime, ["cache.capacity_experts=6", "prefetch.budget=2",
                                                 f"cache.policy={request.param}"])
    yield handle
    assert handle.proc.poll() is None, handle.log()[-2000:]
    assert handle.stop() == 0


class Peer:
    """A bare DEALER that said Hello."""

    def __init__(self, endpoint: str, hello: bool = True) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.decoder = Decoder(CacheToWorker, max_bytes=1 << 24)
        if hello:
            self.sock.send(encode(Hello("hostile", os.getpid(), {})))
            self.reply()

    def reply(self):
        assert self.sock.poll(REPLY_WAIT_MS), "no reply: the manager hung or died"
        return self.decoder.decode(self.sock.recv())

    def ask(self, message):
        self.sock.send(encode(message))
        return self.reply()

    def stats(self) -> dict:
        reply = self.ask(StatsReq(U64))
        assert isinstance(reply, StatsRep) and reply.seq == U64
        return reply.stats

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def peer(manager):
    p = Peer(manager.endpoint)
    yield p
    p.close()


ids = st.one_of(st.integers(0, 9), st.integers(0, U64))
id_lists = st.one_of(st.lists(ids, max_size=12), st.lists(st.integers(0, 7), max_size=1024))
layers = st.one_of(st.integers(0, 3), st.integers(0, U64))
seqs = st.one_of(st.just(0), st.just(U64), st.integers(0, U64))

acquires = st.builds(AcquireReq, seq=seqs, layer=layers, experts=id_lists,
                     release_layers=st.lists(layers, max_size=8), token=st.text(max_size=64),
                     step=st.one_of(st.just(-1), st.integers(-1, 2**63 - 1)))
hints = st.builds(PrefetchHint, layer=layers, experts=id_lists)
releases = st.builds(Release, seq=seqs, layers=st.lists(layers, max_size=16))


@given(message=st.one_of(acquires, hints, releases))
def test_hostile_values_get_a_typed_answer_or_are_counted(peer, message):
    if isinstance(message, AcquireReq):
        reply = peer.ask(message)
        assert isinstance(reply, (AcquireRep, AcquireError)) and reply.seq == message.seq
        if isinstance(reply, AcquireError):
            assert reply.code in ACQUIRE_CODES, reply
        else:
            assert len(reply.slots) == len(message.experts)
    elif isinstance(message, Release):
        reply = peer.ask(message)
        assert isinstance(reply, (Released, Rejected)) and \
            (isinstance(reply, Released) or reply.code == "unknown_layer"), reply
    else:
        before = peer.stats()["n_prefetch_hint"]
        peer.sock.send(encode(message))
        assert peer.stats()["n_prefetch_hint"] == before + 1  # and no reply came before it
    assert isinstance(peer.ask(Release(1, [])), Released)  # pins never pile up


@given(message=st.one_of(acquires, hints, releases, st.builds(StatsReq, seq=seqs)))
def test_a_peer_that_said_no_hello_is_refused(manager, message):
    stranger = Peer(manager.endpoint, hello=False)
    try:
        reply = stranger.ask(message)
        assert isinstance(reply, Rejected) and reply.code == "unexpected"
    finally:
        stranger.close()


def test_after_the_storm_a_normal_client_is_served(manager, peer):
    with CacheClient(manager.endpoint) as client:
        assert len(client.acquire(0, [1, 2])) == 2
        stats = client.stats()
    assert stats["policy"] in ("lru", "flashmoe")
    assert stats["resident"] + stats["loading"] <= stats["capacity"] == 6
    assert stats["pinned"] <= 2 and manager.proc.poll() is None
    refused = sum(v for k, v in stats.items() if k.startswith("refused_"))
    assert refused > 0 and stats["rejected_unexpected"] > 0
