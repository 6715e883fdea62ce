"""The inline prefetcher's memory: the token table is bounded whatever the vocabulary, and a
worker's token in progress goes with the worker."""

import numpy as np

from services.cache_manager import prefetcher as pf
from services.cache_manager.prefetcher import NextLayerPrefetcher


def serve_token(p, worker, token, rng):
    for layer in range(p.L):
        p.after_request(None, worker, layer, list(rng.choice(p.E, p.K, replace=False)), token,
                        hint=False)


def test_token_table_stays_bounded_for_100k_distinct_tokens():
    """A vocabulary past the cap costs the cap; the newest tokens keep their rows."""
    p = NextLayerPrefetcher(4, 16, 2)
    assert p.max_token_rows * p.L * p.E * 4 <= pf.TOKEN_TABLE_BYTES or \
        p.max_token_rows == pf.MIN_TOKEN_ROWS
    for i in range(100_000):
        p._token_row_to_learn(f"tok{i}")
    assert len(p.token_row) == p.max_token_rows == len(p.token_seen)
    assert p.token_uses.shape[0] == p.max_token_rows
    assert "tok99999" in p.token_row and "tok0" not in p.token_row  # least recent went


def test_full_table_reuses_the_least_recently_learned_row(monkeypatch):
    monkeypatch.setattr(pf, "MIN_TOKEN_ROWS", 4)
    monkeypatch.setattr(pf, "MAX_TOKEN_ROWS", 4)
    p = NextLayerPrefetcher(2, 8, 2)
    rng = np.random.default_rng(0)
    for token in ["a", "b", "c", "d", "a", "e", "f"]:  # "a" learned again: "b" goes first
        serve_token(p, "w", token, rng)
    serve_token(p, "w", "end", rng)  # the last token is learned when the next one starts
    assert list(p.token_row) == ["d", "a", "e", "f"]
    assert len(p.token_seen) == 4
    row_f = p.token_row["f"]
    assert p.token_seen[row_f] == 1  # a reused row starts from zero
    assert p.token_seen[p.token_row["a"]] == 2


def test_table_below_the_cap_gives_each_new_token_the_next_row():
    p = NextLayerPrefetcher(2, 8, 2)
    rng = np.random.default_rng(1)
    for i in range(300):
        serve_token(p, "w", f"t{i}", rng)
    serve_token(p, "w", "end", rng)
    assert [p.token_row[f"t{i}"] for i in range(300)] == list(range(300))
    assert len(p.token_seen) == 512 and p.token_seen[:300].sum() == 300


def test_worker_gone_drops_its_stream():
    p = NextLayerPrefetcher(2, 8, 2)
    rng = np.random.default_rng(2)
    for worker in range(50):
        serve_token(p, worker, "x", rng)
    for worker in range(50):
        p.worker_gone(worker)
    p.worker_gone("never-seen")
    assert p._streams == {}
