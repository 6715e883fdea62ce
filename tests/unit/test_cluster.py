"""The cluster's pure parts: envelopes and their validation, the token-weighted merge, and a
warm start applied to an extractor and a learner (no Redis here: see
tests/integration/test_redis_sharing.py)."""

import numpy as np
import pytest

from common.cluster import (
    ModelShape,
    Patterns,
    PayloadError,
    decode,
    encode,
    extractor_values,
    merge,
    parse_device,
    predictor_values,
)
from common.config import load_config
from flashmoe.sim.learning import Learning, cluster_shape
from services.feature_extractor.sharing import apply_to_extractor, extractor_patterns
from services.predictor.sharing import learner_patterns, write_predictor_checkpoint

L, E, K = 3, 8, 2


def config():
    return load_config(env={}, overrides=["features.pca_components=8", "predictor.model=lstm",
                                          "predictor.lstm_hidden=32"])


def trained(seed: int, tokens: int) -> Learning:
    """A learning path fed ``tokens`` random tokens (routing skewed towards low experts)."""
    rng = np.random.default_rng(seed)
    learning = Learning.create(L, E, K, config())
    for t in range(tokens):
        experts = np.stack([rng.choice(E, K, replace=False, p=_skew(seed)) for _ in range(L)])
        learning.extractor.on_event(0, t, f"w{t % 7}", f"w{(t + 1) % 7}", experts, None)
    return learning


def _skew(seed: int) -> np.ndarray:
    weights = np.arange(E, 0, -1, dtype=float) ** (1 + seed)
    return weights / weights.sum()


def shape() -> ModelShape:
    return cluster_shape(L, E, config())


def values_of(learning: Learning, device: str) -> dict:
    patterns = extractor_patterns(learning.extractor, device)
    weights, meta = learner_patterns(learning.learner)
    return {**extractor_values(patterns, 1), **predictor_values(device, 0, weights, meta, 2)}


def test_envelope_roundtrip_and_every_kind_of_garbage():
    raw = encode("popularity", "a", 7, 12, b"body")
    header, body = decode(raw, "popularity", 1 << 20)
    assert body == b"body" and header["tokens"] == 12 and header["generation"] == 7
    cases = {b"nonsense-bytes-here": "magic", raw[:6]: "too short",
             raw[:-1] + b"X": "checksum", raw.replace(b"FMCL\x01", b"FMCL\x09", 1): "version"}
    for bad, words in cases.items():
        with pytest.raises(PayloadError, match=words):
            decode(bad, "popularity", 1 << 20)
    with pytest.raises(PayloadError, match="header does not match"):
        decode(raw, "transitions", 1 << 20)
    with pytest.raises(PayloadError, match="over cluster.max_bytes"):
        decode(raw, "popularity", 10)


def test_parse_device_checks_shapes_dtypes_and_the_total_size():
    learning = trained(0, 40)
    good = values_of(learning, "a")
    peer = parse_device(good, "a", shape(), 4 << 20)
    assert peer.tokens == 40 and peer.predictor is not None and peer.pca is not None
    wrong_shape = dict(good, popularity=extractor_values(
        Patterns("a", 40, np.zeros(L * E + 1, np.float32), peer.transitions,
                 peer.transition_rows), 1)["popularity"])
    with pytest.raises(PayloadError, match="popularity is float32"):
        parse_device(wrong_shape, "a", shape(), 4 << 20)
    wrong_dtype = dict(good, transitions=extractor_values(
        Patterns("a", 40, peer.popularity, peer.transitions.astype(np.float64),
                 peer.transition_rows), 1)["transitions"])
    with pytest.raises(PayloadError, match="counts is float64"):
        parse_device(wrong_dtype, "a", shape(), 4 << 20)
    with pytest.raises(PayloadError, match="published by"):
        parse_device(good, "b", shape(), 4 << 20)
    with pytest.raises(PayloadError, match="over cluster.max_bytes"):
        parse_device(good, "a", shape(), 64 << 10)
    other = load_config(env={}, overrides=["features.pca_components=8", "predictor.model=lstm",
                                           "predictor.lstm_hidden=64"])
    with pytest.raises(PayloadError, match="predictor"):
        parse_device(good, "a", cluster_shape(L, E, other), 4 << 20)


def test_merge_weights_by_tokens_and_takes_the_biggest_peers_predictor():
    small, big = trained(0, 30), trained(1, 90)
    peers = [parse_device(values_of(small, "small"), "small", shape(), 4 << 20),
             parse_device(values_of(big, "big"), "big", shape(), 4 << 20)]
    warm = merge(peers)
    assert warm.tokens == 120 and warm.peers == ["big", "small"] and warm.source == "big"
    expected = 0.25 * peers[0].popularity + 0.75 * peers[1].popularity
    np.testing.assert_allclose(warm.popularity, expected, rtol=1e-6)
    np.testing.assert_allclose(warm.transitions, peers[0].transitions + peers[1].transitions)
    assert merge([]) is None


def test_warm_start_reaches_the_extractor_and_the_learner(tmp_path):
    peer = trained(1, 60)
    warm = merge([parse_device(values_of(peer, "p"), "p", shape(), 4 << 20)])
    fresh = Learning.create(L, E, K, config())
    apply_to_extractor(fresh.extractor, warm)
    fx = fresh.extractor.features
    np.testing.assert_allclose(fx.long_run_freq, warm.popularity)
    np.testing.assert_array_equal(fx.transition_counts, peer.extractor.features.transition_counts)
    np.testing.assert_array_equal(fresh.extractor.pca.basis, peer.extractor.pca.basis)
    folder = write_predictor_checkpoint(warm, tmp_path / "ckpt")
    fresh.learner.load(folder)
    for (name, mine), theirs in zip(fresh.learner.net.state_dict().items(),
                                    peer.learner.net.state_dict().values()):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=2e-3, err_msg=name)
