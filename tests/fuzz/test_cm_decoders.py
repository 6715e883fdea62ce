"""Every decoder of common/protocol.py against hostile frames: random bytes, well-formed
envelopes around junk, and valid frames of every message truncated or with bytes changed.
A decoder returns a message of its union or raises ProtocolError; nothing else escapes."""

import msgpack
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common import protocol
from common.protocol import (SCHEMA_VERSION, CacheToWorker, ControlReply, ControlRequest,
                             Decoder, LearningMessage, Message, ProtocolError, WorkerToCache,
                             encode)

UNIONS = {"WorkerToCache": WorkerToCache, "CacheToWorker": CacheToWorker,
          "LearningMessage": LearningMessage, "ControlRequest": ControlRequest,
          "ControlReply": ControlReply}


def members(union) -> tuple[type, ...]:
    return union.__args__


def sample_value(info):
    """A valid value of a msgspec type (the smallest that passes its constraints)."""
    t = msgspec.inspect
    if isinstance(info, t.IntType):
        return max(1, info.ge or 0)
    if isinstance(info, t.FloatType):
        return 0.5
    if isinstance(info, t.BoolType):
        return True
    if isinstance(info, t.StrType):
        return "x"
    if isinstance(info, t.BytesType):
        return b"\x01\x02\x03\x04"
    if isinstance(info, t.ListType):
        return [sample_value(info.item_type)]
    if isinstance(info, t.TupleType):
        return tuple(sample_value(item) for item in info.item_types)
    if isinstance(info, t.DictType):
        return {sample_value(info.key_type): sample_value(info.value_type)}
    if isinstance(info, t.UnionType):
        return sample_value(info.types[0])
    if isinstance(info, t.AnyType):
        return 1
    raise AssertionError(f"no sample for {info!r}")


def sample_message(cls: type[Message]) -> Message:
    info = msgspec.inspect.type_info(cls)
    return cls(**{f.name: sample_value(f.type) for f in info.fields})


ALL_MESSAGES = sorted({cls for union in UNIONS.values() for cls in members(union)},
                      key=lambda c: c.__name__)
SAMPLES = [encode(sample_message(cls)) for cls in ALL_MESSAGES]


def check(union, frame: bytes) -> None:
    try:
        message = Decoder(union, max_bytes=1 << 20).decode(frame)
    except ProtocolError as exc:
        assert exc.code in ("malformed", "wrong_version", "oversized")
        return
    assert isinstance(message, members(union))


def test_every_message_class_has_a_sample_that_round_trips():
    assert {cls.__name__ for cls in ALL_MESSAGES} >= {
        name for name in dir(protocol)
        if isinstance(getattr(protocol, name), type)
        and issubclass(getattr(protocol, name), Message) and getattr(protocol, name) is not Message}
    for cls, frame in zip(ALL_MESSAGES, SAMPLES):
        for name, union in UNIONS.items():
            if cls in members(union):
                assert Decoder(union).decode(frame) == sample_message(cls), (cls, name)


@pytest.mark.parametrize("union", UNIONS.values(), ids=UNIONS.keys())
@given(frame=st.binary(max_size=512))
def test_random_bytes(union, frame):
    check(union, frame)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=20)
tags = st.sampled_from([cls.__name__ for cls in ALL_MESSAGES] + ["Nope", ""])


@pytest.mark.parametrize("union", UNIONS.values(), ids=UNIONS.keys())
@given(tag=tags, fields=st.lists(msgpack_values, max_size=12),
       version=st.sampled_from([SCHEMA_VERSION, SCHEMA_VERSION, SCHEMA_VERSION - 1, -1, 2**40]))
def test_well_formed_envelopes_around_junk(union, tag, fields, version):
    check(union, msgpack.packb([version, [tag, *fields]]))


@pytest.mark.parametrize("union", UNIONS.values(), ids=UNIONS.keys())
@given(data=st.data())
def test_truncated_and_mutated_valid_frames(union, data):
    frame = bytearray(data.draw(st.sampled_from(SAMPLES)))
    how = data.draw(st.sampled_from(["truncate", "flip", "insert", "extend"]))
    if how == "truncate":
        frame = frame[:data.draw(st.integers(0, len(frame) - 1))]
    elif how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(frame) - 1))
            frame[i] = data.draw(st.integers(0, 255))
    elif how == "insert":
        i = data.draw(st.integers(0, len(frame)))
        frame[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    else:
        frame += data.draw(st.binary(min_size=1, max_size=8))
    check(union, bytes(frame))
