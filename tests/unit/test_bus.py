"""The shared socket plumbing: runtime folder, typed inbox, sequence gaps, control socket."""

import os
import stat
import threading
from collections import Counter

import msgpack
import pytest
import zmq

from common.bus import (ControlServer, Inbox, PeerWatch, Publisher, SeqGaps, ServiceUnavailable,
                        Subscriber, control_endpoint_for, control_request, handshake_mismatch,
                        health, ipc_endpoint, make_runtime_dir, make_socket, stats)
from common.config import load_config
from common.protocol import (SCHEMA_VERSION, ControlReply, Decoder, HealthReq, ProtocolError,
                             Rejected, StatsReq, WorkerToCache, encode)

CONFIG = load_config(env={})


def test_runtime_dir_is_private_and_socket_files_too(tmp_path):
    config = load_config(env={}, overrides=[f"ipc.runtime_dir={tmp_path / 'rt'}"])
    runtime = make_runtime_dir(config)
    assert runtime == tmp_path / "rt" and stat.S_IMODE(runtime.stat().st_mode) == 0o700
    endpoint = ipc_endpoint(runtime, "svc")
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, config, bind=endpoint)
    path = runtime / "svc.sock"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    sock.close(0)
    ctx.term()
    assert make_runtime_dir(load_config(env={})).name.startswith("flashmoe-run-")
    assert control_endpoint_for(endpoint) == f"ipc://{runtime}/svc.control.sock"
    with pytest.raises(ValueError, match="explicitly"):
        control_endpoint_for("tcp://127.0.0.1:5555")


def test_inbox_counts_and_returns_bad_frames():
    counters = Counter()
    inbox = Inbox(WorkerToCache, 1024, counters, "test")
    assert isinstance(inbox.decode(b"\xc1"), ProtocolError)
    assert isinstance(inbox.decode(b"\x00" * 2000), ProtocolError)
    bad_version = msgpack.packb([SCHEMA_VERSION + 1, ["StatsReq", 1]])
    assert inbox.decode(bad_version).code == "wrong_version"
    assert inbox.decode(encode(StatsReq(3))) == StatsReq(3)
    assert counters == {"rejected_malformed": 1, "rejected_oversized": 1,
                        "rejected_wrong_version": 1}


def test_seq_gaps_counts_losses_reorders_and_restarts():
    counters = Counter()
    gaps = SeqGaps(counters)
    for seq in (0, 1, 2, 5, 6, 4):
        gaps.observe("pub", seq, epoch=1)
    assert counters["n_gap"] == 2 and counters["n_out_of_order"] == 1
    assert gaps.observe("pub", 0, epoch=2) == 0  # a restarted publisher starts afresh
    assert gaps.observe("other", 10, epoch=1) == 0
    assert counters["n_received"] == 8 and counters["n_gap"] == 2


def test_handshake_compares_only_shared_sections_and_only_with_digests():
    mine = CONFIG.section_digests()
    other = load_config(env={}, overrides=["store.block_size=128K", "io.queue_depth=2"])
    assert handshake_mismatch(mine, other.section_digests(), ("store", "cache")) == ["store"]
    assert handshake_mismatch(mine, other.section_digests(), ("cache", "ipc")) == []
    assert handshake_mismatch(mine, {}, ("store",)) == []  # a bare client


def test_control_server_answers_health_stats_and_rejects_garbage(tmp_path):
    ctx = zmq.Context()
    endpoint = ipc_endpoint(tmp_path, "svc.control")
    lock = threading.Lock()
    server = ControlServer(ctx, CONFIG, endpoint, "svc", stats=lambda: {"n": 7},
                           state=lambda: "running", lock=lock)
    try:
        rep = health(endpoint)
        assert rep.service == "svc" and rep.pid == os.getpid() and rep.state == "running"
        assert stats(endpoint) == {"n": 7}
        assert isinstance(control_request(endpoint, HealthReq(9)), type(rep))
        with lock:  # the service's loop holds the lock: stats wait, health does not
            assert health(endpoint).state == "running"
            with pytest.raises(ServiceUnavailable):
                stats(endpoint, timeout_s=0.3)
        raw = ctx.socket(zmq.DEALER)
        raw.connect(endpoint)
        raw.send(b"garbage")
        assert raw.poll(5000)
        assert isinstance(Decoder(ControlReply).decode(raw.recv()), Rejected)
        raw.close(0)
        assert server.counters["rejected_malformed"] == 1
    finally:
        server.close()
        ctx.term()
    with pytest.raises(ServiceUnavailable, match="within"):
        health(endpoint, timeout_s=0.2)


def test_control_server_reports_a_bind_failure(tmp_path):
    ctx = zmq.Context()
    with pytest.raises(zmq.ZMQError):
        ControlServer(ctx, CONFIG, "tcp://256.0.0.1:1", "svc", stats=dict,
                      state=lambda: "running", lock=threading.Lock())
    ctx.term()


def test_peer_watch_names_the_peer_that_went_away(tmp_path):
    ctx = zmq.Context()
    endpoint = ipc_endpoint(tmp_path, "router")
    router = make_socket(ctx, zmq.ROUTER, CONFIG, bind=endpoint)
    watch = PeerWatch(router)
    peers = []
    for name in (b"a", b"b"):
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, name)
        dealer.connect(endpoint)
        dealer.send(b"hello")
        peers.append(dealer)
    for _ in peers:
        assert router.poll(5000)
        frames = router.recv_multipart(copy=False)
        watch.remember(frames[0].bytes, frames[1])
    peers[0].close(0)
    gone = []
    for _ in range(100):
        if watch.socket.poll(50):
            gone += watch.disconnected()
        if gone:
            break
    assert gone == [b"a"]
    peers[1].close(0)
    watch.close()
    router.close(0)
    ctx.term()


def test_publisher_subscriber_roundtrip_with_typed_inbox(tmp_path):
    ctx = zmq.Context()
    endpoint = ipc_endpoint(tmp_path, "pub")
    pub = Publisher(ctx, CONFIG, endpoint)
    counters = Counter()
    sub = Subscriber(ctx, CONFIG, [endpoint], WorkerToCache, counters, "sub")
    got = []
    for _ in range(100):  # the slow joiner: publish until the subscription is live
        pub.publish(StatsReq(1))
        if sub.socket.poll(20):
            got = sub.drain()
            break
    assert got and all(m == StatsReq(1) for m in got)
    pub.socket.send(b"junk")
    assert sub.socket.poll(2000)
    sub.drain()
    assert counters["rejected_malformed"] == 1
    sub.close()
    pub.close()
    ctx.term()
