"""Hostile peers' payloads (hypothesis): a device's values with any header field swapped for
any JSON (lists, strings, NaN, huge or nested values), any body, any array of any dtype,
shape and values, any predictor.json field. ``parse_device`` raises ``PayloadError`` and
nothing else; whatever it accepts, the sharing code takes in without an error: the merge,
the extractor's warm start and the predictor's checkpoint written from the peer and loaded."""

import hashlib
import json
import struct
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from common.cluster import (
    MAGIC,
    VERSION,
    PayloadError,
    encode_arrays,
    extractor_values,
    merge,
    parse_device,
    predictor_values,
)
from common.config import load_config
from flashmoe.sim.learning import Learning, cluster_shape
from services.feature_extractor.core import ExtractorCore
from services.feature_extractor.sharing import apply_to_extractor, extractor_patterns
from services.predictor.sharing import learner_patterns, write_predictor_checkpoint

L, E, K, PCA = 2, 4, 2, 4
CONFIG = load_config(env={}, overrides=[f"features.pca_components={PCA}"])
SHAPE = cluster_shape(L, E, CONFIG)
MAX_BYTES = CONFIG.cluster.max_bytes


def _values() -> dict[str, bytes]:
    learning = Learning.create(L, E, K, CONFIG)
    rng = np.random.default_rng(0)
    for t in range(60):
        experts = np.stack([rng.choice(E, K, replace=False) for _ in range(L)])
        learning.extractor.on_event(0, t, f"w{t % 3}",
                                    f"w{(t + 1) % 3}", experts, None)
    weights, meta = learner_patterns(learning.learner)
    patterns = extractor_patterns(learning.extractor, "peer")
    return {**extractor_values(patterns, 7),
            **predictor_values("peer", patterns.tokens, weights, meta, 7)}


GOOD = _values()
assert parse_device(GOOD, "peer", SHAPE, MAX_BYTES).predictor is not None


def split(raw: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack_from("<I", raw, 6)
    return json.loads(raw[10:10 + length]), raw[10 + length:]


def envelope(header: dict, body: bytes, fix: bool = True) -> bytes:
    if fix:  # the length and checksum right, so the hostile part is what gets checked
        header = {**header, "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    text = json.dumps(header).encode()
    return struct.pack("<4sHI", MAGIC, VERSION, len(text)) + text + body


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=8)
parts = st.sampled_from(sorted(GOOD))


@st.composite
def header_swaps(draw):
    what = draw(parts)
    header, body = split(GOOD[what])
    field = draw(st.sampled_from(sorted(header) + ["extra"]))
    header[field] = draw(json_values)
    return what, envelope(header, body, fix=field not in ("bytes", "sha256"))


@st.composite
def body_swaps(draw):
    what = draw(parts)
    header, _ = split(GOOD[what])
    body = draw(st.one_of(st.binary(max_size=200), st.text(max_size=20).map(str.encode),
                          json_values.map(lambda v: json.dumps(v).encode())))
    return what, envelope(header, body)


dtypes = st.sampled_from([np.float16, np.float32, np.float64, np.int32, np.int64, np.uint8])
special = st.sampled_from([0.0, -1.0, 1e30, -1e30, float("nan"), float("inf"), 2.0, 1e15 * 2])


@st.composite
def array_swaps(draw):
    what = draw(st.sampled_from(["popularity", "transitions", "pca", "predictor.safetensors"]))
    header, body = split(GOOD[what])
    from safetensors.numpy import load as st_load
    arrays = st_load(body)
    name = draw(st.sampled_from(sorted(arrays)))
    good = arrays[name]
    if draw(st.booleans()):  # the right shape and dtype, hostile values
        value = good.astype(np.float64).copy()
        flat = value.reshape(-1)
        if flat.size:
            for i in draw(st.lists(st.integers(0, flat.size - 1), max_size=4)):
                flat[i] = draw(special)
        with np.errstate(over="ignore", invalid="ignore"):
            value = value.astype(good.dtype)
    else:
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        with np.errstate(invalid="ignore", over="ignore"):
            value = np.full(shape, draw(special)).astype(draw(dtypes))
    arrays[name] = value
    if draw(st.booleans()):
        arrays[draw(st.text(min_size=1, max_size=5))] = np.zeros(2, np.float32)
    return what, envelope(header, encode_arrays(arrays))


@st.composite
def meta_swaps(draw):
    header, body = split(GOOD["predictor.json"])
    meta = json.loads(body)
    field = draw(st.sampled_from(sorted(meta) + ["extra"]))
    meta[field] = draw(json_values)
    return "predictor.json", envelope(header, json.dumps(meta).encode())


@given(swaps=st.lists(st.one_of(header_swaps(), body_swaps(), array_swaps(), meta_swaps()),
                      min_size=1, max_size=3),
       missing=st.sets(parts, max_size=2))
def test_a_hostile_payload_is_payload_error_or_taken_in_cleanly(swaps, missing):
    values = dict(GOOD)
    for what, raw in swaps:
        values[what] = raw
    for what in missing:
        values[what] = None
    try:
        peer = parse_device(values, "peer", SHAPE, MAX_BYTES)
    except PayloadError:
        return
    warm = merge([peer])
    if warm is None:
        return
    core = ExtractorCore(L, E, K, PCA)
    apply_to_extractor(core, warm)
    assert np.isfinite(core.features.long_run_freq).all()
    X, z = core.on_event(0, 0, "a", "b", [[0, 1], [2, 3]], [])
    assert np.isfinite(X).all() and np.isfinite(z).all()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_predictor_checkpoint(warm, Path(tmp) / "peer")
        if folder is not None:
            learning = Learning.create(L, E, K, CONFIG)
            learning.learner.load(folder)


@given(raw=st.binary(max_size=300), what=parts)
def test_random_bytes_are_payload_error(raw, what):
    values = dict(GOOD)
    values[what] = raw
    try:
        parse_device(values, "peer", SHAPE, MAX_BYTES)
    except PayloadError:
        pass
