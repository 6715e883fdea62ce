"""Faults: corrupt blocks, a killed manager, garbage on the socket. Nothing hangs or crashes."""

import os
import signal
import threading
import time

import msgpack
import pytest
import zmq

from common.cache_client import CacheClient, CacheManagerUnavailable, ExpertLoadError
from common.protocol import SCHEMA_VERSION, AcquireReq, Decoder, CacheToWorker, Hello, encode
from tests.support.stores import flip_byte


def test_corrupt_block_fails_that_expert_and_service_stays_up(store_copy, start_manager):
    bad_block = flip_byte(store_copy, 1, 3, block_index=1)
    manager = start_manager(store_copy)
    with CacheClient(manager.endpoint) as client:
        with pytest.raises(ExpertLoadError) as info:
            client.acquire(1, [2, 3])
        assert info.value.code == "checksum" and info.value.experts == [3]
        assert f"block {bad_block}" in str(info.value)
        # The service is still up and serves good experts, including the one beside it.
        assert len(client.acquire(1, [2, 4])) == 2
        with pytest.raises(ExpertLoadError):  # and the bad one is not cached as good
            client.acquire(1, [3])
        stats = client.stats()
    # two acquires, each reading the bad expert twice (the retry) before it fails
    assert stats["n_checksum_error"] == 4 and stats["n_read_retry"] == 2
    assert manager.proc.poll() is None


def test_killed_manager_gives_typed_error_quickly(tiny_store, start_manager):
    manager = start_manager(tiny_store)
    client = CacheClient(manager.endpoint)
    client.config.ipc.acquire_timeout_s = 60.0  # the disconnect, not the timeout, must end it
    try:
        client.acquire(0, [0, 1])
        outcome = {}

        def acquire_many():
            started = time.monotonic()
            try:
                for i in range(100000):
                    client.acquire(i % 2, [i % 8, (i + 3) % 8])
            except CacheManagerUnavailable as exc:
                outcome["error"] = exc
            outcome["seconds"] = time.monotonic() - started

        thread = threading.Thread(target=acquire_many)
        thread.start()
        time.sleep(0.3)  # requests are in flight
        os.kill(manager.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        thread.join(20)
        assert not thread.is_alive(), "worker hung after the cache manager died"
        assert isinstance(outcome.get("error"), CacheManagerUnavailable)
        assert time.monotonic() - killed_at < 10
        with pytest.raises(CacheManagerUnavailable):  # stays failed, fails fast
            client.acquire(0, [0])
    finally:
        client.close()


def test_silent_manager_hits_the_timeout_naming_the_setting(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)  # accepts the connection, never answers
    endpoint = f"ipc://{tmp_path}/silent.sock"
    router.bind(endpoint)
    from common.config import load_config

    config = load_config(env={}, overrides=["ipc.handshake_timeout_s=0.3"])
    started = time.monotonic()
    with pytest.raises(CacheManagerUnavailable, match="ipc.handshake_timeout_s"):
        CacheClient(endpoint, config=config)
    assert time.monotonic() - started < 5
    router.close(0)
    ctx.term()


def test_sigterm_sends_dead_to_workers(tiny_store, start_manager):
    manager = start_manager(tiny_store)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(manager.endpoint)
    decoder = Decoder(CacheToWorker)
    sock.send(encode(Hello("raw", os.getpid(), {})))
    assert sock.poll(10000)
    decoder.decode(sock.recv())
    manager.proc.terminate()
    assert sock.poll(10000), "no Dead sentinel after SIGTERM"
    message = decoder.decode(sock.recv())
    assert type(message).__name__ == "Dead" and "shut down" in message.reason
    assert manager.proc.wait(10) == 0
    sock.close(0)
    ctx.term()


BAD_FRAMES = {
    "malformed": [b"\xc1\xc1 not msgpack"],
    "wrong_version": [msgpack.packb([SCHEMA_VERSION + 7, ["AcquireReq", 1, 0, [1]]])],
    "oversized": [b"\x00" * (1 << 20)],
    "bad_fields": [msgpack.packb([SCHEMA_VERSION, ["AcquireReq", 1, -5, ["x"]]])],
    "two_frames": [encode(AcquireReq(1, 0, [1])), b"extra"],
    "pickle": [b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00\x8c\x01a\x94."],
}


def test_garbage_is_rejected_counted_and_service_survives(tiny_store, start_manager):
    manager = start_manager(tiny_store)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(manager.endpoint)
    decoder = Decoder(CacheToWorker, max_bytes=1 << 20)
    codes = {}
    # Before Hello: a valid request is refused as unexpected.
    raw.send(encode(AcquireReq(1, 0, [1])))
    assert raw.poll(10000)
    codes["no_hello"] = decoder.decode(raw.recv()).code
    for name, frames in BAD_FRAMES.items():
        raw.send_multipart(frames)
        assert raw.poll(10000), f"no answer to {name}"
        codes[name] = decoder.decode(raw.recv()).code
    assert codes == {"no_hello": "unexpected", "malformed": "malformed",
                     "wrong_version": "wrong_version", "oversized": "oversized",
                     "bad_fields": "malformed", "two_frames": "malformed",
                     "pickle": "malformed"}
    raw.close(0)
    ctx.term()
    with CacheClient(manager.endpoint) as client:  # still serving
        assert len(client.acquire(0, [0, 1])) == 2
        stats = client.stats()
    assert stats["rejected_malformed"] == 4 and stats["rejected_wrong_version"] == 1
    assert stats["rejected_oversized"] == 1 and stats["rejected_unexpected"] == 1
    assert manager.proc.poll() is None


def test_bad_store_fails_at_start_with_a_clear_message(tmp_path, start_manager):
    manager = start_manager(tmp_path)  # not a store
    assert manager.proc.wait(30) != 0
    assert "no manifest.json" in manager.log()
