"""The predictor's and the extractor's fast paths against their plain definitions."""

import numpy as np
import pytest
import torch

from services.feature_extractor.core import FeatureExtractor
from services.predictor.core import window_labels
from services.predictor.model import (BUCKETS, HEADS, INV, INV_SHIFTED, Net, bucket_nll,
                                      estimates)

L, E, K, DIMS, FEATURES = 3, 8, 2, 16, 5


def _net(core: str) -> Net:
    torch.manual_seed(1)
    net = Net(L, E, DIMS, FEATURES, core, hidden=8)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(std=0.3)
    return net


@pytest.mark.parametrize("core", ["lstm", "linear"])
def test_one_step_equals_the_sequence_forward(core):
    net = _net(core)
    z, x = torch.randn(4, L, DIMS), torch.randn(4, L * E, FEATURES)
    with torch.no_grad():
        whole, _ = net(z, x)
        state = None
        for t in range(4):  # token by token, the state carried as inference carries it
            logits, state = net.step(z[t].numpy(), x[t].numpy(), state)
            assert logits.shape == (HEADS, BUCKETS, L * E)
            np.testing.assert_allclose(logits, whole[t].numpy(), rtol=1e-5, atol=1e-5)


def test_the_bucket_likelihood_is_the_bucket_or_the_tail_when_censored():
    torch.manual_seed(2)
    logits = torch.randn(3, HEADS, BUCKETS, 7)
    bucket = torch.randint(0, BUCKETS, (3, HEADS, 7))
    censored = torch.rand(3, HEADS, 7) < 0.5
    nll = bucket_nll(logits, bucket, censored)
    p = torch.softmax(logits, 2)
    for t, h, n in np.ndindex(3, HEADS, 7):
        b = int(bucket[t, h, n])
        want = p[t, h, b:, n].sum() if censored[t, h, n] else p[t, h, b, n]
        assert float(nll[t, h, n]) == pytest.approx(-float(torch.log(want + 1e-9)), abs=1e-5)


def test_window_labels_give_the_distance_to_the_next_use():
    used = np.zeros((6, 2), bool)
    used[[1, 4], 0] = True  # expert 0 at steps 1 and 4; expert 1 never
    bucket_a, cens_a, _, _, _ = window_labels(used, 3)
    # head A at step j: the distance from j to the next use (1 = used at j)
    assert cens_a[:, 0].tolist() == [False, False, False]
    assert bucket_a[:, 0].tolist() == [1, 0, 2]  # distances 2, 1, 3 -> buckets 2, 1, 3-4
    assert cens_a[:, 1].all()


def test_transition_counts_count_each_pair_of_consecutive_tokens_once():
    rng = np.random.default_rng(3)
    fx = FeatureExtractor(L, E, K)
    want = np.zeros((L, E, E))
    prev = None
    for position in range(20):
        experts = np.stack([rng.choice(E, K, replace=False) for _ in range(L)])
        fx.step(f"t{position}", position)
        fx.observe(experts)
        if prev is not None:
            for layer in range(L):
                for src in prev[layer]:
                    for dst in experts[layer]:
                        want[layer, src, dst] += 1
        prev = experts
    np.testing.assert_array_equal(fx.tr_c, want)
    np.testing.assert_array_equal(fx.tr_n, want.sum(2) / K)


def test_a_first_use_warm_up_of_another_network_is_made_again(tmp_path):
    import json

    from common.config import load_config
    from flashmoe.learning import warmup_fits

    lstm = load_config(env={}, overrides=["predictor.model=lstm"])
    linear = load_config(env={}, overrides=["predictor.model=linear"])
    assert not warmup_fits(tmp_path, lstm)  # nothing there
    (tmp_path / "predictor.json").write_text("{not json")
    assert not warmup_fits(tmp_path, lstm)
    (tmp_path / "predictor.json").write_text(json.dumps({"params": {"model": "lstm",
                                                                    "hidden": 64}}))
    assert not warmup_fits(tmp_path, lstm)  # no extractor.json
    (tmp_path / "extractor.json").write_text(json.dumps({"pca_components": 128}))
    assert warmup_fits(tmp_path, lstm) and not warmup_fits(tmp_path, linear)
    fewer = load_config(env={}, overrides=["predictor.model=lstm", "features.pca_components=64"])
    assert not warmup_fits(tmp_path, fewer)


def test_the_estimate_is_the_harmonic_mean_distance_in_its_three_variants():
    rng = np.random.default_rng(4)
    P = rng.random((HEADS, BUCKETS, 9)).astype(np.float32)
    P /= P.sum(1, keepdims=True)
    S = estimates(P, L)
    d0 = 1 / (INV @ P[0])
    d1 = P[0, 1:].sum(0) / (INV_SHIFTED @ P[0, 1:])  # given a distance >= 2, a token later
    d2 = 1 / (INV @ P[1])
    np.testing.assert_allclose(S, L * (np.stack([d0, d1, d2]) - 1), rtol=1e-5)
