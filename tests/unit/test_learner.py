"""The predictor's and the extractor's fast paths against their plain definitions."""

import numpy as np
import pytest
import torch

from services.feature_extractor.core import FeatureExtractor
from services.predictor.core import window_labels
from services.predictor.model import (BUCKETS, HEADS, INV, INV_SHIFTED, INV_SHIFTED2, Net,
                                      bucket_nll, estimates)

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
    np.testing.assert_array_equal(fx.transition_counts, want)
    np.testing.assert_array_equal(fx.transition_sources, want.sum(2) / K)


def test_a_first_use_warm_up_of_another_network_is_made_again(tmp_path):
    import json

    from common.config import load_config
    from flashmoe.sim.learning import warmup_fits

    lstm = load_config(env={}, overrides=["predictor.model=lstm"])
    linear = load_config(env={}, overrides=["predictor.model=linear"])
    assert not warmup_fits(tmp_path, lstm)  # nothing there
    (tmp_path / "predictor.json").write_text("{not json")
    assert not warmup_fits(tmp_path, lstm)
    (tmp_path / "predictor.json").write_text(json.dumps({"params": {"model": "lstm",
                                                                    "hidden": 64},
                                                         "L": 24, "E": 32}))
    assert not warmup_fits(tmp_path, lstm)  # no extractor.json
    (tmp_path / "extractor.json").write_text(json.dumps({"pca_components": 128,
                                                         "L": 24, "E": 32}))
    assert warmup_fits(tmp_path, lstm) and not warmup_fits(tmp_path, linear)
    fewer = load_config(env={}, overrides=["predictor.model=lstm", "features.pca_components=64"])
    assert not warmup_fits(tmp_path, fewer)
    # another model's topology: made for 24 layers x 32 experts, not for 16 x 64
    assert warmup_fits(tmp_path, lstm, (24, 32)) and not warmup_fits(tmp_path, lstm, (16, 64))


def test_an_extractor_checkpoints_arrays_and_meta_come_from_one_save(tmp_path):
    import json

    from services.feature_extractor.core import ExtractorCore, load_checkpoint, save_checkpoint

    rng = np.random.default_rng(5)
    core = ExtractorCore(L, E, K, 8)

    def feed(tokens):
        for position in range(tokens):
            core.on_event(0, core.features.t, f"t{position % 5}", f"t{(position + 1) % 5}",
                          np.stack([rng.choice(E, K, replace=False) for _ in range(L)]), [])

    feed(10)
    save_checkpoint(core, tmp_path)
    first_json = (tmp_path / "extractor.json").read_text()
    feed(10)
    save_checkpoint(core, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extractor.json",
                                                          "extractor.safetensors"]
    (tmp_path / "extractor.json").write_text(first_json)  # a save cut between its two files
    resumed = ExtractorCore(L, E, K, 8)
    assert load_checkpoint(resumed, tmp_path)["tokens"] == 20 == resumed.features.t
    np.testing.assert_array_equal(resumed.features.token_uses[:len(resumed.features.token_row)],
                                  core.features.token_uses[:len(core.features.token_row)])
    with pytest.raises(ValueError, match=f"{L} layers x {E} experts .* does not fit 2 x {E}"):
        load_checkpoint(ExtractorCore(2, E, K, 8), tmp_path)
    assert json.loads(first_json)["tokens"] == 10


def test_the_estimate_is_the_harmonic_mean_distance_in_its_five_variants():
    rng = np.random.default_rng(4)
    P = rng.random((HEADS, BUCKETS, 9)).astype(np.float32)
    P /= P.sum(1, keepdims=True)
    S = estimates(P, L)
    d0 = 1 / (INV @ P[0])
    d1 = P[0, 1:].sum(0) / (INV_SHIFTED @ P[0, 1:])  # given a distance >= 2, a token later
    d2 = 1 / (INV @ P[1])
    d3 = P[1, 1:].sum(0) / (INV_SHIFTED @ P[1, 1:])  # head B, the same
    d4 = P[0, 2:].sum(0) / (INV_SHIFTED2 @ P[0, 2:])  # given >= 3, two tokens later
    np.testing.assert_allclose(S, L * (np.stack([d0, d1, d2, d3, d4]) - 1), rtol=1e-5)
    # by the distances themselves: a bucket's representative distance, minus the shift
    reps = 1 / INV
    np.testing.assert_allclose(INV_SHIFTED2, 1 / (reps[2:] - 2))


def _reference(net: Net, z: np.ndarray, x: np.ndarray, state=None):
    """S and P(used next token) by the numpy path: Net.step, the softmax, estimates()."""
    logits, state = net.step(z, x, state)
    P = torch.softmax(torch.from_numpy(logits), 1).numpy()
    return estimates(P, L), P[0, 0], state


@pytest.mark.parametrize("core", ["lstm", "linear"])
@pytest.mark.parametrize("precision,rtol", [("fp32", 1e-4), ("bf16", 3e-2), ("int8", 5e-2)])
def test_the_fused_inference_equals_the_numpy_path(core, precision, rtol):
    from services.predictor import fast_infer

    if fast_infer.load() is None:
        pytest.skip(fast_infer.why_not())
    net = _net(core)
    fused = fast_infer.FusedInference(net, precision)
    rng = np.random.default_rng(7)
    state_ref = state = None
    for _ in range(3):  # the LSTM state carried over tokens
        z = rng.standard_normal((L, DIMS)).astype(np.float32)
        x = rng.random((L * E, FEATURES)).astype(np.float32)
        S_ref, p_ref, state_ref = _reference(net, z, x, state_ref)
        h, state = net.recurrent_step(z, state)
        S, p_used = fused(h, x)
        np.testing.assert_allclose(p_used, p_ref, rtol=rtol, atol=rtol * 0.1)
        np.testing.assert_allclose(S, S_ref, rtol=rtol, atol=rtol)
    if precision != "fp32":  # a copy of the heads: off the float32 weights by their rounding
        assert not np.array_equal(S, S_ref)


def test_the_fused_inference_follows_the_weights_after_a_training_step():
    from common.config import PredictorConfig
    from services.predictor import fast_infer
    from services.predictor.core import Learner

    if fast_infer.load() is None:
        pytest.skip(fast_infer.why_not())
    learner = Learner(L, E, DIMS, FEATURES,
                      PredictorConfig(train_every_tokens=4, window_tokens=4))
    assert learner.inference == "fused C, int8 heads"  # the default
    rng = np.random.default_rng(3)
    for _ in range(8):  # two training steps
        z = rng.standard_normal((L, DIMS)).astype(np.float32)
        x = rng.random((L * E, FEATURES)).astype(np.float32)
        learner.predict(x, z)
        learner.observe(rng.choice(L * E, size=L * K, replace=False))
    assert learner.steps == 2
    S = learner.predict(x, z)
    S_ref, p_ref, _ = _reference(learner.net, z, x)
    np.testing.assert_allclose(S, S_ref, rtol=5e-2, atol=5e-2)
    np.testing.assert_allclose(learner.last_p_used, p_ref, rtol=5e-2, atol=5e-3)
    with torch.no_grad():  # weights changed outside a training step: the copy is stale
        learner.net.head.mul_(-1.0)
    S_new, _, _ = _reference(learner.net, z, x)
    assert not np.allclose(learner.fused(z, x)[0], S_new, rtol=5e-2, atol=5e-2)
    learner.refresh_inference()
    np.testing.assert_allclose(learner.fused(z, x)[0], S_new, rtol=5e-2, atol=5e-2)


def test_the_deferred_pca_covariance_is_the_running_update():
    from services.feature_extractor.core import OnlinePCA

    rng = np.random.default_rng(5)
    pca = OnlinePCA(dim=12, components=4, every=40)
    mean, cov, weight = np.zeros(12), np.zeros((12, 12)), 0.0
    for n in range(1, 121):  # refits at 40, 50, 80 and 120 read the covariance mid-stream
        vectors = rng.standard_normal((6, 12)) * np.linspace(0.5, 3, 12)
        pca.update(vectors)
        weight = 0.998 * weight + 1.0  # the update as defined, one product at a time
        a = 1.0 / weight
        mean = (1 - a) * mean + a * vectors.mean(0)
        centred = vectors - mean
        cov = (1 - a) * cov + (a / len(vectors)) * (centred.T @ centred)
        if n in (3, 77):
            np.testing.assert_allclose(pca.cov, cov, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(pca.state()["cov"], cov, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(pca.mean, mean, rtol=1e-12)


@pytest.mark.parametrize("core", ["lstm", "linear"])
def test_the_precision_report_sizes_each_inference_path(core):
    from common.config import FlashMoEConfig
    from flashmoe.sim.learning import Learning
    from flashmoe.bench.learning_report import precision_report
    from services.predictor import fast_infer

    config = FlashMoEConfig()
    config.predictor.model = core
    learning = Learning.create(L, E, K, config)
    report = precision_report(learning, steps=3, cold_calls=2)
    assert report["numpy_fp32"]["bytes"] == 4 * report["parameters"]
    if fast_infer.load() is not None:
        sizes = [report[f"fused_{p}"]["bytes"] for p in ("fp32", "bf16", "int8")]
        assert sizes[0] == report["numpy_fp32"]["bytes"] and sizes[0] > sizes[1] > sizes[2]
    assert ("torch_int8_lstm" in report) == (core == "lstm")
    assert all(v["infer_us"] > 0 and v["infer_us_cold"] > 0
               for v in report.values() if isinstance(v, dict))
