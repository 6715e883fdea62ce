"""Hostile trace files, in each format common/traces.py reads: a FlashMoE trace file (.npz) with
any meta and arrays of any type and shape, garbage or cut-short bytes, warp JSONL rows of any
value, and a gpt-oss-20b folder (routing.npz + meta.jsonl) with hostile rows. Loading raises
TraceError and nothing else; a trace that loads can be replayed (its token stream is made)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.traces import (TRACE_FORMAT, TRACE_VERSION, WARP_FILES, TokenStream, TraceError,
                           load_trace, load_trace_file)

JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
DTYPES = st.sampled_from(["int8", "int16", "int64", "uint64", "float16", "float64", "bool",
                          "complex64", "U3", "S2"])
SHAPES = st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple)


@st.composite
def arrays(draw) -> np.ndarray:
    shape, dtype = draw(SHAPES), draw(DTYPES)
    raw = draw(st.lists(st.integers(-40_000, 40_000), min_size=int(np.prod(shape)),
                        max_size=int(np.prod(shape))))
    return np.array(raw).reshape(shape).astype(dtype)


@st.composite
def metas(draw):
    meta = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "model": "m",
            "num_experts": 8, "sequences": []}
    for key in draw(st.lists(st.sampled_from(sorted(meta)), max_size=3, unique=True)):
        if draw(st.booleans()):
            del meta[key]
        else:
            meta[key] = draw(JSON_VALUES)
    return draw(st.one_of(st.just(meta), JSON_VALUES)) if draw(st.integers(0, 9)) == 0 else meta


def valid_arrays(draw) -> dict:
    tokens = draw(st.integers(0, 6))
    experts = np.array(draw(st.lists(st.integers(0, 7), min_size=tokens * 4,
                                     max_size=tokens * 4)), dtype=np.int16).reshape(tokens, 2, 2)
    return {"experts": experts, "offsets": np.array([0, tokens], dtype=np.int64)}


def npz_bytes(arrays_: dict) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays_)
    return buffer.getvalue()


def loads_or_trace_error(load) -> None:
    try:
        trace = load()
    except TraceError:
        return
    TokenStream.of(trace)
    assert trace.experts.dtype == np.int16 and trace.experts.max(initial=0) < trace.num_experts


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-traces")


@given(data=st.data())
def test_a_trace_file_with_hostile_meta_and_arrays_is_a_trace_error(folder, data):
    parts = valid_arrays(data.draw)
    for name in data.draw(st.lists(st.sampled_from(["experts", "offsets", "probs"]), max_size=3,
                                   unique=True), label="swapped"):
        parts[name] = data.draw(arrays(), label=name)
    meta = data.draw(metas(), label="meta")
    parts["meta"] = np.array(json.dumps(meta, allow_nan=True))
    if data.draw(st.booleans(), label="drop a part"):
        parts.pop(data.draw(st.sampled_from(sorted(parts))))
    path = folder / "t.npz"
    path.write_bytes(npz_bytes(parts))
    loads_or_trace_error(lambda: load_trace_file(path))
    loads_or_trace_error(lambda: load_trace(str(path)))


@given(data=st.data())
def test_garbage_and_cut_short_trace_files_are_trace_errors(folder, data):
    good = npz_bytes({**valid_arrays(data.draw), "meta": np.array(json.dumps(
        {"format": TRACE_FORMAT, "version": TRACE_VERSION, "num_experts": 8}))})
    kind = data.draw(st.sampled_from(["cut", "flip", "bytes", "deep"]), label="kind")
    if kind == "cut":
        content = good[:data.draw(st.integers(0, len(good) - 1))]
    elif kind == "flip":
        at = data.draw(st.integers(0, len(good) - 1))
        content = good[:at] + bytes([good[at] ^ data.draw(st.integers(1, 255))]) + good[at + 1:]
    elif kind == "bytes":
        content = data.draw(st.binary(max_size=300))
    else:
        content = npz_bytes({**valid_arrays(data.draw), "meta": np.array("[" * 100_000)})
    path = folder / "g.npz"
    path.write_bytes(content)
    loads_or_trace_error(lambda: load_trace_file(path))


def test_a_zip_member_of_an_unknown_version_or_damaged_deflate_is_a_trace_error(folder):
    """zipfile raises NotImplementedError for an extract version it does not know and
    zlib.error for a damaged compressed member: both are TraceError (found by the report run)."""
    arrays_ = {"experts": np.zeros((3, 2, 2), np.int16), "offsets": np.array([0, 3], np.int64),
               "meta": np.array(json.dumps({"format": TRACE_FORMAT, "version": TRACE_VERSION,
                                            "num_experts": 8}))}
    good = bytearray(npz_bytes(arrays_))
    central = good.index(b"PK\x01\x02")
    good[central + 6] = 109  # "version needed to extract": 10.9
    path = folder / "v.npz"
    path.write_bytes(bytes(good))
    with pytest.raises(TraceError):
        load_trace_file(path)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays_)
    packed = bytearray(buffer.getvalue())
    body = packed.index(b"PK\x03\x04") + 30 + int.from_bytes(packed[26:28], "little") + \
        int.from_bytes(packed[28:30], "little")
    packed[body:body + 8] = b"\xff" * 8  # the first member's deflate stream
    path.write_bytes(bytes(packed))
    with pytest.raises(TraceError):
        load_trace_file(path)


@given(lines=st.lists(st.one_of(
    JSON_VALUES.map(lambda v: json.dumps({"layers": v}, allow_nan=True)),
    JSON_VALUES.map(lambda v: json.dumps(v, allow_nan=True)),
    st.lists(st.lists(st.lists(st.integers(-3, 70_000), min_size=1, max_size=3), min_size=1,
                      max_size=2), min_size=1, max_size=2).map(lambda v: json.dumps({"layers": v})),
    st.text(max_size=20), st.just("[" * 50_000)), min_size=1, max_size=4))
def test_hostile_warp_rows_are_trace_errors(folder, lines):
    (folder / "warp").mkdir(exist_ok=True)
    (folder / "warp" / WARP_FILES["olmoe"][0]).write_text("\n".join(lines))
    loads_or_trace_error(lambda: load_trace("warp:olmoe", folder))


@given(data=st.data())
def test_a_hostile_gptoss20b_folder_is_a_trace_error(folder, data):
    gpt = folder / "gptoss20b"
    gpt.mkdir(exist_ok=True)
    parts = valid_arrays(data.draw)
    parts["experts"] = parts["experts"] % 8
    parts["probs"] = np.ones(parts["experts"].shape, dtype=np.float16)
    for name in data.draw(st.lists(st.sampled_from(sorted(parts)), max_size=2, unique=True)):
        parts[name] = data.draw(arrays(), label=name)
    (gpt / "routing.npz").write_bytes(npz_bytes(parts))
    row = {"has_repetition": False, "dataset": "mmlu_test", "category": "c", "n_decode_tokens": 1,
           "first_token_pos": 0, "generated_only": ["a"]}
    rows = [row]
    for key in data.draw(st.lists(st.sampled_from(sorted(row)), max_size=2, unique=True)):
        rows = [{**row, key: data.draw(JSON_VALUES)}]
    if data.draw(st.booleans()):
        rows = data.draw(st.lists(JSON_VALUES, max_size=3))
    (gpt / "meta.jsonl").write_text("\n".join(json.dumps(r, allow_nan=True) for r in rows))
    for split in ("eval", "train"):
        loads_or_trace_error(lambda: load_trace(f"gptoss20b:{split}", folder))
