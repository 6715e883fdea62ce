import msgpack
import pytest

from common.protocol import (SCHEMA_VERSION, AccessEvent, AcquireError, AcquireRep, AcquireReq,
                             CacheToWorker, ControlReply, ControlRequest, Dead, Decoder,
                             FeatureBatch, HealthRep, HealthReq, LearningMessage, Prediction,
                             Hello, PrefetchHint, ProtocolError, Ready, Rejected, Release,
                             StatsRep, StatsReq, WorkerToCache, encode)

WORKER_MESSAGES = [Hello("w", 12, {"store": "abc"}), AcquireReq(3, 1, [4, 7]),
                   AcquireReq(4, 2, [1], [1, 0]), PrefetchHint(3, [1, 2]), Release(5),
                   Release(6, [2]), StatsReq(6)]
CACHE_MESSAGES = [Ready("arena", 4096, 8, "/s", "uring", {"cache": "d"}), AcquireRep(3, 1, [0, 2]),
                  AcquireError(3, 1, "checksum", "bad", [7]), StatsRep(1, {"n_hit": 3, "e": "x"}),
                  Rejected("malformed", "m"), Dead("bye")]


@pytest.mark.parametrize("message", WORKER_MESSAGES)
def test_worker_messages_roundtrip(message):
    assert Decoder(WorkerToCache).decode(encode(message)) == message


@pytest.mark.parametrize("message", CACHE_MESSAGES)
def test_cache_messages_roundtrip(message):
    assert Decoder(CacheToWorker).decode(encode(message)) == message


LEARNING = [AccessEvent("w", 7, 0, 1, 2, "the", " cat", [[1, 2], [3, 4]], [[0.6, 0.4]] * 2),
            AccessEvent("w", 7, 1, 1, 3, " cat", "", [[1, 2], [3, 4]], []),
            FeatureBatch("fx", 8, 0, 0, "w", 3, [[1, 2], [3, 4]], 2, 4, b"\0" * 32, 4,
                         b"\0" * 16, 1, 0.97),
            Prediction("p", 9, 0, 0, 3, 2, 4, 3, b"\0" * 96)]


@pytest.mark.parametrize("message", LEARNING)
def test_learning_messages_roundtrip(message):
    assert Decoder(LearningMessage, max_bytes=1 << 20).decode(encode(message)) == message


@pytest.mark.parametrize("message", [HealthReq(1), StatsReq(2)])
def test_control_requests_roundtrip(message):
    assert Decoder(ControlRequest).decode(encode(message)) == message


def test_control_replies_roundtrip():
    reply = HealthRep(1, "cache_manager", 42, "running", 1.5)
    assert Decoder(ControlReply).decode(encode(reply)) == reply


def test_wire_is_plain_msgpack_with_version():
    version, body = msgpack.unpackb(encode(AcquireReq(3, 1, [4, 7], [0], "the", 12,
                                                      [0.75, 0.25])))
    assert version == SCHEMA_VERSION and body == ["AcquireReq", 3, 1, [4, 7], [0], "the", 12,
                                                  [0.75, 0.25]]


def test_an_acquire_without_its_step_says_none():
    """A request that leaves the step out (-1) says the worker publishes no events."""
    frame = msgpack.packb([SCHEMA_VERSION, ["AcquireReq", 3, 1, [4, 7], [0], "the"]])
    message = Decoder(WorkerToCache).decode(frame)
    assert message.step == -1 and message.weights == []  # and its router weights unknown


@pytest.mark.parametrize("frame, code", [
    (msgpack.packb([SCHEMA_VERSION + 1, ["AcquireReq", 1, 0, [1]]]), "wrong_version"),
    (b"\xc1garbage", "malformed"),
    (msgpack.packb({"not": "an envelope"}), "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["Pickle", 1]]), "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["AcquireReq", 1, -2, [1]]]), "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["AcquireReq", 1, 0, [1], [], "", -2]]), "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["AcquireReq", 1, 0, "x"]]), "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["Ready", "a", 1, 1, "/s", "u", {}]]), "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["AcquireReq", 1, 0, [1], [-1]]]), "malformed"),
    # router weights: negative, NaN, infinite
    (msgpack.packb([SCHEMA_VERSION, ["AcquireReq", 1, 0, [1], [], "", -1, [-0.5]]]),
     "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["AcquireReq", 1, 0, [1], [], "", -1, [float("nan")]]]),
     "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["AcquireReq", 1, 0, [1], [], "", -1, [float("inf")]]]),
     "malformed"),
    (msgpack.packb([SCHEMA_VERSION, ["Hello", "w", 1, "not a table"]]), "malformed"),
    (b"\x00" * 70000, "oversized"),
])
def test_bad_frames_raise_protocol_error_with_code(frame, code):
    with pytest.raises(ProtocolError) as info:
        Decoder(WorkerToCache, max_bytes=65536).decode(frame)
    assert info.value.code == code
