"""The trace simulator: request model, next-use oracle, metrics."""

import numpy as np
import pytest

from common.config import ConfigError, FlashMoEConfig
from common.traces import Trace, TraceError
from flashmoe.sim.device_model import DEVICES, MODEL_SHAPES
from flashmoe.sim.replay import (build_requests, capacity_for, next_use_positions, replay,
                                run_bench)
from services.cache_manager.policies import make_policy


def tiny_trace():
    rng = np.random.default_rng(1)
    experts = np.stack([np.stack([rng.choice(8, size=2, replace=False) for _ in range(3)])
                        for _ in range(30)]).astype(np.int16)
    return Trace("tiny", experts, np.array([0, 10, 30]), 8, "olmoe-1b-7b")


def test_global_requests_are_token_then_layer_major():
    trace = tiny_trace()
    req = build_requests(trace, "global")
    t, layer, k = 4, 2, 1
    i = (t * 3 + layer) * 2 + k
    assert req.keys[i] == layer * 8 + trace.experts[t, layer, k]
    assert req.token_layer[i] == t * 3 + layer and list(req.starts) == [0, 30 * 3 * 2]


def test_layer_requests_reset_per_sequence_and_layer():
    trace = tiny_trace()
    req = build_requests(trace, "layer")
    assert len(req.starts) - 1 == 2 * 3  # sequences x layers
    first = req.keys[req.starts[0]:req.starts[1]]
    assert np.array_equal(first, trace.experts[0:10, 0, :].reshape(-1))
    second_seq_layer2 = req.keys[req.starts[5]:req.starts[6]]
    assert np.array_equal(second_seq_layer2, trace.experts[10:30, 2, :].reshape(-1))


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_next_use_matches_brute_force_within_each_cache_lifetime(scope):
    req = build_requests(tiny_trace(), scope)
    nxt = next_use_positions(req)
    keys, starts = req.keys.tolist(), req.starts.tolist()
    for a, b in zip(starts[:-1], starts[1:]):
        for i in range(a, b):
            later = [j for j in range(i + 1, b) if keys[j] == keys[i]]
            assert nxt[i] == (later[0] if later else 1 << 62)


def test_replay_equals_a_plain_loop_over_fresh_caches():
    trace = tiny_trace()
    req = build_requests(trace, "layer")
    hits = replay("lru", 2, req)
    expected = []
    for a, b in zip(req.starts[:-1], req.starts[1:]):
        cache = make_policy("lru", 2)
        expected += [cache.request(int(k)) for k in req.keys[a:b]]
    assert hits.tolist() == expected


def test_capacity_rounds_down_like_the_readme():
    trace = Trace("g", np.zeros((1, 24, 4), np.int16), np.array([0, 1]), 32, "gpt-oss-20b")
    assert capacity_for(0.0625, trace, "global") == 48
    assert capacity_for(0.0625, trace, "layer") == 2
    with pytest.raises(TraceError, match="at least one expert"):
        capacity_for(0.01, trace, "layer")


def test_bench_report_keys_gap_and_device_model():
    report = run_bench(tiny_trace(), "global", [0.25, 0.5], ["lru", "arc", "belady"],
                       DEVICES["orin-980pro"], MODEL_SHAPES["olmoe-1b-7b"], jobs=2,
                       progress=False)
    rows = report["results"]
    assert len(rows) == 6
    for row in rows:
        assert {"policy", "scope", "capacity", "capacity_fraction", "accesses", "hits",
                "hit_rate", "ssd_bytes", "gap_closed", "ms_per_token",
                "ssd_mb_per_s"} <= set(row)
        assert row["ssd_bytes"] == (row["accesses"] - row["hits"]) * MODEL_SHAPES["olmoe-1b-7b"].expert_bytes
    by = {(r["policy"], r["capacity"]): r for r in rows}
    for cap in (6, 12):
        assert by[("lru", cap)]["gap_closed"] == 0 and by[("belady", cap)]["gap_closed"] == 1
        assert by[("belady", cap)]["ms_per_token"] <= by[("lru", cap)]["ms_per_token"]
    compute = DEVICES["orin-980pro"].compute_ms_per_layer(MODEL_SHAPES["olmoe-1b-7b"])
    assert all(r["ms_per_token"] >= 3 * compute for r in rows)


def test_bench_with_prefetch_reports_stall_free_rate_and_prefetch_counts():
    """``--prefetch``: the inline prefetcher for every policy but Belady, FlashMoE's
    look-ahead besides; rows gain the stall-free rate and the prefetch counts."""
    trace = tiny_trace()
    report = run_bench(trace, "global", [0.5], ["lru", "nextuse", "belady", "flashmoe"],
                       DEVICES["orin-980pro"], MODEL_SHAPES["olmoe-1b-7b"], jobs=1,
                       progress=False, prefetch=True)
    by = {r["policy"]: r for r in report["results"]}
    bytes_per_expert = MODEL_SHAPES["olmoe-1b-7b"].expert_bytes
    for name in ("lru", "nextuse", "flashmoe"):
        row = by[name]
        assert row["stall_free_rate"] == row["hit_rate"]
        assert row["prefetch_used"] + row["prefetch_wasted"] <= row["prefetch_issued"]
        assert row["prefetch_bytes"] == row["prefetch_issued"] * bytes_per_expert
        assert row["prefetch_learned"] >= 0
    assert by["lru"]["prefetch_learned"] == by["nextuse"]["prefetch_learned"] == 0
    assert "prefetch_issued" not in by["belady"] or by["belady"]["prefetch_issued"] == 0


def test_core_mode_belady_is_the_bound_in_the_layer_scope_too():
    """Each layer's Belady in the core is fed the next uses of its own layer's requests (not the
    whole token-major stream): no policy beats it, and it stays near the per-request replay's
    Belady (the core can only do worse: a request's experts are held together, where the replay
    may evict one of them for the next)."""
    rng = np.random.default_rng(3)
    experts = np.stack([np.stack([rng.choice(8, size=2, replace=False, p=w) for w in
                                  (np.full(8, 1 / 8), np.linspace(1, 3, 8) / 16, np.full(8, 1 / 8))])
                        for _ in range(60)]).astype(np.int16)
    trace = Trace("skewed", experts, np.array([0, 25, 60]), 8, "olmoe-1b-7b")
    report = run_bench(trace, "layer", [0.5], ["lru", "arc", "belady"],
                       DEVICES["orin-980pro"], MODEL_SHAPES["olmoe-1b-7b"], jobs=1,
                       progress=False)
    hits = {r["policy"]: r["hits"] for r in report["results"]}
    req = build_requests(trace, "layer")
    bound = int(replay("belady", 4, req).sum())
    assert 0.95 * bound <= hits["belady"] <= bound
    assert hits["belady"] > max(hits["lru"], hits["arc"])


def test_prefetch_inline_off_leaves_only_the_look_ahead_in_the_bench_too():
    """``prefetch.inline = false`` turns the inline prefetcher off in the bench as it does in
    the cache manager: LRU then prefetches nothing."""
    issued = {}
    for inline in (True, False):
        config = FlashMoEConfig()
        config.prefetch.inline = inline
        config.prefetch.threshold = 0.05  # hint readily on a trace this short
        report = run_bench(tiny_trace(), "global", [0.5], ["lru"], DEVICES["orin-980pro"],
                           MODEL_SHAPES["olmoe-1b-7b"], jobs=1, progress=False, prefetch=True,
                           config=config)
        issued[inline] = report["results"][0]["prefetch_issued"]
    assert issued[True] > 0 and issued[False] == 0


def test_the_inline_prefetcher_hints_beside_the_look_ahead_only_when_told():
    """In the bench as in the cache manager, the inline prefetcher keeps its hints back while
    FlashMoE's look-ahead runs on a usable estimate (it learns on), unless
    ``prefetch.inline_with_learned``; before the first estimate it hints as for any policy."""
    from common.config import FlashMoEConfig
    from flashmoe.sim.replay import _hooks_for, replay_core

    plain = tiny_trace()
    words = [{"generated_only": [f"w{i % 5}" for i in range(n + 1)]}
             for n in np.diff(plain.offsets).tolist()]  # a next token: estimates are made
    trace = Trace("tiny", plain.experts, plain.offsets, 8, "olmoe-1b-7b", sequences=words)
    shape = MODEL_SHAPES["olmoe-1b-7b"]
    hints = {}
    for beside in (False, True):
        config = FlashMoEConfig()
        config.prefetch.threshold = 0.05  # hint readily on a trace this short
        config.prefetch.inline_with_learned = beside
        hooks, _ = _hooks_for("flashmoe", trace, config, {"prefetch": True})
        replay_core("flashmoe", 12, trace, "global", DEVICES["orin-980pro"], shape.expert_bytes,
                    0.5, hooks=hooks, prefetch_budget=config.prefetch.budget,
                    prefetch_window=config.prefetch.window)
        assert hooks.published > 0 and hooks.prefetcher.stats["tokens"] > 20
        hints[beside] = hooks.prefetcher.stats["hints"]
    assert 0 < hints[False] < hints[True]


def test_bench_precisions_give_a_row_each_and_random_follows_dynamic():
    """``--precision``: uniform copies for every policy, dynamic and random only for the
    learned one (random in a second phase, with the fractions of dynamic's loads); a copy's
    loads read its bytes; each row's mix is its computations' shares of the router weight."""
    trace = tiny_trace()
    shape = MODEL_SHAPES["olmoe-1b-7b"]
    report = run_bench(trace, "global", [0.25], ["lru", "flashmoe"], DEVICES["orin-980pro"],
                       shape, jobs=1, progress=False,
                       precisions=("native", "int4", "dynamic", "random"))
    rows = {(r["policy"], r["precision"]): r for r in report["results"]}
    assert set(rows) == {("lru", "native"), ("lru", "int4"), ("flashmoe", "native"),
                         ("flashmoe", "int4"), ("flashmoe", "dynamic"), ("flashmoe", "random")}
    int4 = rows[("lru", "int4")]
    assert int4["precision_mix"] == {"int4": 1.0}
    assert int4["hit_rate"] > rows[("lru", "native")]["hit_rate"]  # 3.5x the experts fit
    assert int4["ssd_bytes"] < rows[("lru", "native")]["ssd_bytes"]
    for key in (("flashmoe", "dynamic"), ("flashmoe", "random")):
        mix = rows[key]["precision_mix"]
        assert set(mix) <= {"native", "int8", "int4"} and abs(sum(mix.values()) - 1) < 1e-9
        assert rows[key]["ssd_bytes"] < rows[("flashmoe", "native")]["ssd_bytes"]


def test_bench_lays_out_the_pools_by_the_configured_split():
    """cache.precision_split reaches the simulated arena: more of the budget's bytes to the
    native pool, more of the router weight computed at native."""
    trace = tiny_trace()
    shape = MODEL_SHAPES["olmoe-1b-7b"]
    native = {}
    for split in ("0.05,0.05,0.9", "0.8,0.1,0.1"):
        config = FlashMoEConfig()
        config.cache.precision_split = split
        report = run_bench(trace, "global", [0.25], ["flashmoe"], DEVICES["orin-980pro"], shape,
                           jobs=1, progress=False, config=config, precisions=("dynamic",))
        native[split] = report["results"][0]["precision_mix"].get("native", 0.0)
    assert native["0.05,0.05,0.9"] < native["0.8,0.1,0.1"]
    config = FlashMoEConfig()
    config.cache.precision_split = "1,2"
    with pytest.raises(ConfigError, match="precision_split"):
        run_bench(trace, "global", [0.25], ["flashmoe"], DEVICES["orin-980pro"], shape, jobs=1,
                  progress=False, config=config, precisions=("dynamic",))
