"""Well-formed learning-path messages with hostile values (hypothesis): whatever an
``AccessEvent`` or a ``FeatureBatch`` that decodes can carry, the extractor's core and the
predictor's batch check either take it or refuse it with their ``Dropped`` (nothing else is
raised, nothing changes on a refusal), and the cores still work on the next good message."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from common.protocol import AccessEvent, Decoder, FeatureBatch, LearningMessage, encode
from common.checks import Dropped
from services.feature_extractor.core import ExtractorCore
from services.feature_extractor.sharing import predictor_inputs
from services.predictor.core import Learner, check_batch

L, E, K, PCA = 3, 8, 2, 4
DIMS, FEATURES = predictor_inputs(E, PCA)
UINT64 = 2 ** 64 - 1
BUS = Decoder(LearningMessage, max_bytes=1 << 20)  # as the bus hands a message over

ids = st.one_of(st.integers(0, E + 2), st.integers(0, UINT64))
rows = st.one_of(st.lists(st.lists(ids, max_size=K + 2), max_size=L + 2),
                st.lists(st.lists(ids, min_size=K, max_size=K), min_size=L, max_size=L))
good_rows = st.lists(st.lists(st.integers(0, E - 1), min_size=K, max_size=K, unique=True),
                     min_size=L, max_size=L)
floats = st.floats(allow_nan=True, allow_infinity=True, width=64)
probs = st.one_of(st.just([]), st.lists(st.lists(floats, max_size=K + 1), max_size=L + 1),
                  st.lists(st.lists(st.floats(0, 1), min_size=K, max_size=K), min_size=L,
                           max_size=L))
text = st.text(max_size=40)


def good_event(t: int) -> tuple:
    return (0, t, f"w{t % 3}", f"w{(t + 1) % 3}",
            [[(t + layer) % E, (t + layer + 1) % E] for layer in range(L)], [])


def fresh_core() -> ExtractorCore:
    core = ExtractorCore(L, E, K, PCA)
    for t in range(6):
        core.on_event(*good_event(t))
    return core


@given(sequence=st.integers(0, UINT64), position=st.integers(0, UINT64), token=text,
       next_token=text, experts=st.one_of(rows, good_rows), probabilities=probs)
def test_hostile_access_events_are_taken_or_dropped(sequence, position, token, next_token,
                                                     experts, probabilities):
    event = AccessEvent("w", 1, 0, sequence, position, token, next_token, experts,
                        probabilities)
    event = BUS.decode(encode(event))
    core = fresh_core()
    t = core.features.t
    try:
        out = core.on_event(event.sequence, event.position, event.input_token,
                            event.next_token, event.experts, event.probs)
    except Dropped:
        assert core.features.t == t  # refused before anything changed
    else:
        assert core.features.t == t + 1
        if out is not None:
            assert all(np.isfinite(a).all() for a in out)
    X, z = core.on_event(*good_event(7))  # and it goes on
    assert np.isfinite(X).all() and np.isfinite(z).all()


byte_lengths = st.integers(0, 4 * L * max(DIMS, FEATURES) * E + 8)


@st.composite
def batches(draw):
    layers = draw(st.sampled_from([L, 0, L + 1, 1 << 40]))
    experts_per_layer = draw(st.sampled_from([E, 0, E * 2]))
    dims = draw(st.sampled_from([DIMS, 0, DIMS + 1, UINT64]))
    features = draw(st.sampled_from([FEATURES, 0, 1, UINT64]))
    if draw(st.booleans()):  # buffers of the right length, hostile values
        z = draw(st.lists(st.floats(width=32), min_size=L * DIMS, max_size=L * DIMS))
        x = draw(st.lists(st.floats(width=16), min_size=L * E * FEATURES,
                          max_size=L * E * FEATURES))
        per_layer = np.asarray(z, np.float32).tobytes()
        per_expert = np.asarray(x, np.float16).tobytes()
    else:
        per_layer = draw(st.binary(max_size=64))
        per_expert = draw(st.binary(max_size=64))
    return FeatureBatch("fx", 1, 0, 0, "w", draw(st.integers(0, UINT64)),
                        draw(st.one_of(rows, good_rows)), layers, experts_per_layer,
                        per_layer, dims, per_expert, features, draw(floats))


LEARNER = Learner(L, E, DIMS, FEATURES)


@given(batch=batches())
def test_hostile_feature_batches_are_taken_or_dropped(batch):
    batch = BUS.decode(encode(batch))
    try:
        z, x, routing = check_batch(batch, L, E, K, DIMS, FEATURES)
    except Dropped:
        pass
    else:
        S = LEARNER.predict(x, z)
        assert np.isfinite(S).all()
        LEARNER.observe((routing + (np.arange(L) * E)[:, None]).reshape(-1))
    S = LEARNER.predict(np.zeros((L * E, FEATURES), np.float32), np.zeros((L, DIMS), np.float32))
    assert np.isfinite(S).all()
