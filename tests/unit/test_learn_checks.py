"""Well-formed learning-path messages with values that do not fit the model: the extractor's
core and the predictor's batch check refuse them (``Dropped`` with a reason) before any state
changes, and go on working."""

import numpy as np
import pytest

from common.protocol import FeatureBatch
from common.checks import Dropped
from services.feature_extractor.core import ExtractorCore
from services.feature_extractor.sharing import predictor_inputs
from services.predictor.core import Learner, check_batch

L, E, K, PCA = 3, 8, 2, 4


def good_routing(t: int) -> list[list[int]]:
    return [[(t + layer) % E, (t + layer + 3) % E] for layer in range(L)]


def fed_core(tokens: int = 20) -> ExtractorCore:
    core = ExtractorCore(L, E, K, PCA)
    for t in range(tokens):
        core.on_event(0, t, f"w{t % 3}", f"w{(t + 1) % 3}", good_routing(t), [[0.6, 0.4]] * L)
    return core


def snapshot(core: ExtractorCore) -> dict:
    fx = core.features
    return {"t": fx.t, "token_uses": fx.token_uses.copy(), "recent": fx.recent_freq.copy(),
            "transitions": fx.transition_counts.copy(), "pca_n": core.pca.n,
            "tokens": dict(fx.token_row)}


@pytest.mark.parametrize("experts, probs, reason", [
    ([[1, E]] + good_routing(0)[1:], [], "expert_range"),  # an id >= E
    ([[1, -1]] + good_routing(0)[1:], [], "expert_range"),
    ([[1, 2]] * (L + 1), [], "layers"),  # another model's layer count
    ([[1, 2]] * (L - 1), [], "layers"),
    ([[1, 2, 3]] * L, [], "top_k"),  # another model's top-k
    ([[1], [1, 2], [3, 4]], [], "top_k"),  # ragged
    ([[1, 1]] + good_routing(0)[1:], [], "duplicate_expert"),
    (good_routing(0), [[0.5, 0.5, 0.0]] * L, "probs_shape"),  # a probs row of the wrong length
    (good_routing(0), [[0.5, 0.5]] * (L - 1), "probs_shape"),
    (good_routing(0), [[float("nan"), 0.5]] * L, "probs_value"),
    (good_routing(0), [[float("inf"), 0.5]] * L, "probs_value"),
    (good_routing(0), [[-0.5, 0.5]] * L, "probs_value"),
])
def test_the_extractor_drops_an_event_that_does_not_fit_the_model(experts, probs, reason):
    core = fed_core()
    before = snapshot(core)
    with pytest.raises(Dropped) as caught:
        core.on_event(0, 20, "w2", "w0", experts, probs)
    assert caught.value.reason == reason
    after = snapshot(core)
    assert after["t"] == before["t"] and after["pca_n"] == before["pca_n"]
    assert after["tokens"] == before["tokens"]
    for name in ("token_uses", "recent", "transitions"):
        assert np.array_equal(after[name], before[name]), name
    X, z = core.on_event(0, 20, "w2", "w0", good_routing(20), [])  # and it goes on
    assert np.isfinite(X).all() and np.isfinite(z).all() and core.features.t == 21


def test_a_huge_position_is_a_feature_not_a_crash():
    core = fed_core(2)
    X, _ = core.on_event(0, 2 ** 64 - 2, "w", "x", good_routing(2), [])
    assert np.isfinite(X).all()


def batch(**changes) -> FeatureBatch:
    dims, features = predictor_inputs(E, PCA)
    fields = dict(source="fx", epoch=1, seq=0, event_seq=0, event_source="w", position=1,
                  experts=good_routing(0), layers=L, experts_per_layer=E,
                  per_layer=np.ones((L, dims), np.float32).tobytes(), dims=dims,
                  per_expert=np.ones((L * E, features), np.float16).tobytes(),
                  features=features, variance_kept=0.5)
    fields.update(changes)
    return FeatureBatch(**fields)


def check(b: FeatureBatch):
    dims, features = predictor_inputs(E, PCA)
    return check_batch(b, L, E, K, dims, features)


@pytest.mark.parametrize("changes, reason", [
    ({"layers": L + 1}, "layers"),
    ({"experts_per_layer": E * 2}, "experts_per_layer"),
    ({"dims": 5}, "dims"),  # another dims than the session's first batch's
    ({"features": 3}, "features"),
    ({"per_layer": b"\0" * 7}, "buffer"),
    ({"per_expert": b""}, "buffer"),
    ({"experts": [[0, E + 5]] * L}, "expert_range"),
    ({"experts": [[0, 1]] * (L + 2)}, "layers"),
    ({"experts": [[0, 1, 2]] * L}, "top_k"),
    ({"experts": [[0, 0]] * L}, "duplicate_expert"),
    ({"dims": 0, "per_layer": b""}, "dims"),
    ({"per_layer": np.full((L, 4), np.nan, np.float32).tobytes()}, "nonfinite"),
    ({"per_expert": np.full((L * E, 15), np.inf, np.float16).tobytes()}, "nonfinite"),
])
def test_the_predictor_drops_a_batch_that_does_not_fit(changes, reason):
    with pytest.raises(Dropped) as caught:
        check(batch(**changes))
    assert caught.value.reason == reason


def test_a_good_batch_passes_and_feeds_the_learner():
    z, x, routing = check(batch())
    dims, features = predictor_inputs(E, PCA)
    learner = Learner(L, E, dims, features)
    S = learner.predict(x, z)
    assert np.isfinite(S).all() and routing.shape == (L, K)
