"""The feature extractor's tables keyed by token text are bounded: an LRU of
``max_token_rows`` rows (the least recently seen token's row cleared and reused), and a
bounded cache of SimHash bits. 100,000 distinct tokens keep them at their cap; a token seen
recently keeps its statistics; a checkpoint after evictions maps every token to its row."""

import numpy as np

from services.feature_extractor import core as extractor_core
from services.feature_extractor.core import (
    ROW_TABLES,
    ExtractorCore,
    ExtractorParams,
    load_checkpoint,
    save_checkpoint,
)

L, E, K, PCA = 2, 4, 2, 0
CAP = 64


def routing(t: int) -> list[list[int]]:
    return [[t % E, (t + 1) % E], [(t + 2) % E, (t + 3) % E]]


def table_bytes(core: ExtractorCore) -> int:
    return sum(getattr(core.features, name).nbytes for name in ROW_TABLES)


def test_100000_distinct_tokens_keep_the_token_tables_at_their_cap():
    core = ExtractorCore(L, E, K, PCA, ExtractorParams(max_token_rows=CAP))
    fx = core.features
    full = None
    experts = np.array(routing(0))
    for t in range(100_000):  # the extractor's own stream calls (the PCA is not keyed by text)
        fx.step(f"tok{t}", t)
        fx.observe(experts)
        if t == 2 * CAP:
            full = table_bytes(core)
    assert len(fx.token_row) == CAP and len(fx.token_seen) == CAP
    assert table_bytes(core) == full  # nothing grew after the cap was reached
    assert sorted(fx.token_row.values()) == list(range(CAP))  # one row each, all used
    assert extractor_core._token_bits.cache_info().currsize <= \
        extractor_core._token_bits.cache_info().maxsize
    assert fx.t == 100_000


def test_the_default_cap_bounds_memory_for_a_vocabulary_past_it():
    params = ExtractorParams()
    core = ExtractorCore(L, E, K, PCA)
    for t in range(params.max_token_rows + 500):
        core.on_event(0, t, f"tok{t}", f"tok{t + 1}", routing(t), [])
    assert len(core.features.token_row) == params.max_token_rows
    assert all(len(getattr(core.features, name)) == params.max_token_rows
               for name in ROW_TABLES)


def test_the_least_recently_seen_token_goes_first_and_its_row_starts_empty():
    core = ExtractorCore(L, E, K, PCA, ExtractorParams(max_token_rows=8))
    fx = core.features
    for t in range(20):  # "keep" comes back every other token: it is never the oldest
        token = "keep" if t % 2 == 0 else f"once{t}"
        core.on_event(0, t, token, "keep" if t % 2 else f"once{t + 1}", routing(t), [])
    assert "keep" in fx.token_row and "once1" not in fx.token_row
    assert fx.token_seen[fx.token_row["keep"]] >= 9
    fresh = fx._row_of("brand-new")
    assert fx.token_seen[fresh] == 0 and not fx.token_uses[fresh].any()


def test_a_checkpoint_after_evictions_maps_each_token_to_its_own_row(tmp_path):
    params = ExtractorParams(max_token_rows=8)
    core = ExtractorCore(L, E, K, PCA, params)
    for t in range(30):
        core.on_event(0, t, f"w{t % 11}", f"w{(t + 1) % 11}", routing(t), [])
    save_checkpoint(core, tmp_path)
    again = ExtractorCore(L, E, K, PCA, params)
    load_checkpoint(again, tmp_path)
    a, b = core.features, again.features
    assert set(a.token_row) == set(b.token_row)
    for token in a.token_row:
        assert a.token_seen[a.token_row[token]] == b.token_seen[b.token_row[token]]
        assert np.array_equal(a.token_uses[a.token_row[token]], b.token_uses[b.token_row[token]])
