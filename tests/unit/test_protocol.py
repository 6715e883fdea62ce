import msgpack
import pytest

from common.protocol import (SCHEMA_VERSION, AcquireError, AcquireRep, AcquireReq, CacheToWorker,
                             Dead, Decoder, Hello, ProtocolError, Ready, Rejected, Release,
                             StatsRep, StatsReq, WorkerToCache, encode)

WORKER_MESSAGES = [Hello("w", 12, "abc"), AcquireReq(3, 1, [4, 7]), Release(5), StatsReq(6)]
CACHE_MESSAGES = [Ready("arena", 4096, 8, "/s", "uring", "d"), AcquireRep(3, 1, [0, 2]),
                  AcquireError(3, 1, "checksum", "bad", [7]), StatsRep(1, {"n_hit": 3, "e": "x"}),
                  Rejected("malformed", "m"), Dead("bye")]


@pytest.mark.parametrize("message", WORKER_MESSAGES)
def test_worker_messages_roundtrip(message):
    assert Decoder(WorkerToCache).decode(encode(message)) == message


@pytest.mark.parametrize("message", CACHE_MESSAGES)
def test_cache_messages_roundtrip(message):
    assert Decoder(CacheToWorker).decode(encode(message)) == message


def test_wire_is_plain_msgpack_with_version():
    version, body = msgpack.unpackb(encode(AcquireReq(3, 1, [4, 7])))
    assert version == SCHEMA_VERSION and body == ["AcquireReq", 3, 1, [4, 7]]


@pytest.mark.parametrize("frame, code", [
    (msgpack.packb([SCHEMA_VERSION + 1, ["AcquireReq", 1, 0, [1]]]), "wrong_version"),
    (b"\xc1garbage", "malformed"),
    (msgpack.packb({"not": "an envelope"}), "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["Pickle", 1]]), "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["AcquireReq", 1, -2, [1]]]), "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["AcquireReq", 1, 0, "x"]]), "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["Ready", "a", 1, 1, "/s", "u", "d"]]), "malformed"),
    (b"\x00" * 70000, "oversized"),
])
def test_bad_frames_raise_protocol_error_with_code(frame, code):
    with pytest.raises(ProtocolError) as info:
        Decoder(WorkerToCache, max_bytes=65536).decode(frame)
    assert info.value.code == code
