"""The layer-aware policies (leaststale, nextuse) through the cache manager's core: their
score, its variants, ties, pins, and the refusal of the per-request replay."""

import numpy as np
import pytest

from services.cache_manager.core import CacheManagerCore
from services.cache_manager.policies import PolicyError, make_policy, needs_core

L, E = 3, 4
KNOWN = {(layer, expert): 1 for layer in range(L) for expert in range(E)}
W = b"w"


def run_tokens(core, tokens):
    """Each token: one acquire per layer (the worker's schedule), loads completed at once."""
    for row in tokens:
        for layer, experts in enumerate(row):
            _, loads, _ = core.acquire(W, layer, experts, release_layers=[(layer - 1) % L])
            for load in loads:
                core.finish_load(load.key, ok=True)


def test_leaststale_evicts_the_layer_visited_last_least_recently_used_first():
    core = CacheManagerCore(KNOWN, n_slots=5, policy="leaststale")
    run_tokens(core, [[[0], [0], [0]]])  # residents (0,0) (1,0) (2,0)
    run_tokens(core, [[[1, 2]]])  # a new token: layer 0 gets (0,1) (0,2); now full
    # At layer 1 the layer visited last is layer 1 itself (needed again only next token):
    # its unpinned expert (1,0) goes before any of layer 0 or 2.
    run_tokens(core, [[[1, 2], [1]]])
    assert (1, 0) not in core.slot_of and {(0, 1), (0, 2), (2, 0)} <= set(core.slot_of)
    # Layer 2 next: among layer 1's (now layer visited before the current one) and layer 2's,
    # layer 2's own (2,0) goes; then layer 1, least recently used first.
    core.acquire(W, 2, [3], release_layers=[1])
    core.finish_load((2, 3), ok=True)
    assert (2, 0) not in core.slot_of
    policy = core.policies[None]
    assert policy.token == 2 and policy.layer == 2


def test_nextuse_prefers_to_keep_frequently_used_experts():
    core = CacheManagerCore(KNOWN, n_slots=4, policy="nextuse", policy_params={"half_life": 2})
    # expert 0 of every layer is used every token; expert 1 of layer 0 only once
    run_tokens(core, [[[0, 1], [0], [0]]] + [[[0], [0], [0]]] * 4)
    policy = core.policies[None]
    assert policy.q[0] > 0.7 and policy.q[1] < 0.15
    run_tokens(core, [[[0, 2], [0], [0]]])  # a miss at layer 0: (0,1) is the victim
    assert (0, 1) not in core.slot_of and (0, 0) in core.slot_of and (0, 2) in core.slot_of


def test_scores_follow_the_layer_order_and_the_variants():
    policy = make_policy("nextuse", 8)
    policy.configure(list(range(L)), E)
    policy.on_request(1)  # the first token, at layer 1
    d = policy.scores() - policy.S[0]
    expected_d = [(layer - 1 - 1) % L for layer in range(L) for _ in range(E)]
    visited = np.arange(L * E) // E <= 1
    base = np.where(visited, policy.S[1], policy.S[0])
    assert np.allclose(policy.scores(), np.array(expected_d) + base)
    assert np.allclose(d[~visited], expected_d[2 * E:])


@pytest.mark.parametrize("name", ["leaststale", "nextuse"])
def test_layer_aware_policies_never_evict_pinned_or_loading_experts(name):
    rng = np.random.default_rng(0)
    core = CacheManagerCore(KNOWN, n_slots=6, policy=name)
    for _ in range(200):
        layer = int(rng.integers(L))
        experts = rng.choice(E, size=2, replace=False).tolist()
        before = set(core.pinned_keys()) | set(core.loading)
        _, loads, _ = core.acquire(W, layer, experts, release_layers=[(layer - 1) % L])
        assert before - {(layer, e) for e in experts} <= set(core.slot_of) | before
        for load in loads[:1]:  # leave some loading
            core.finish_load(load.key, ok=True)
        for key in list(core.loading):
            core.finish_load(key, ok=True)
        assert len(core.policies[None]) <= 6


@pytest.mark.parametrize("name", ["leaststale", "nextuse"])
def test_the_per_request_replay_cannot_run_them(name):
    assert needs_core(name)
    policy = make_policy(name, 4)
    with pytest.raises(PolicyError, match="core"):
        policy.on_request(0)


def test_leaststale_per_layer_lists_pick_the_scored_rankings_victims():
    """Least-Stale's per-layer LRU lists are a shortcut for scored.py's ranking (S = 0): the
    same victim, request after request, with pins and the request's own experts excluded."""
    from services.cache_manager.policies.scored import ScoredPolicy

    rng = np.random.default_rng(1)
    fast = make_policy("leaststale", 6)
    fast.configure(list(range(L)), E)
    resident: list[tuple[int, int]] = []
    layer, evictions = -1, 0
    for _ in range(2000):
        layer = (layer + 1) % L if rng.random() < 0.8 else int(rng.integers(L))
        experts = rng.choice(E, size=2, replace=False).tolist()
        fast.on_request(layer, experts)
        pinned = {resident[i] for i in rng.choice(len(resident), min(2, len(resident)),
                                                  replace=False)} if resident else set()
        for e in experts:
            key = (layer, e)
            if key in fast:
                fast.on_hit(key)
                continue
            if len(fast) >= fast.capacity:
                want = ScoredPolicy.victim(fast, pinned)  # the generic ranking
                got = fast.victim(pinned)
                assert got == want
                evictions += 1
                fast.on_evict(got)
                resident.remove(got)
            fast.on_insert(key)
            resident.append(key)
    assert evictions > 500


@pytest.mark.parametrize("name", ["nextuse", "flashmoe"])
def test_the_kept_variant_per_key_is_the_one_scores_selects(name):
    """Ranking reads each key's S variant from an array kept up to date as layers are visited
    and experts used (and when a new estimate arrives); it must equal scores()' choice."""
    rng = np.random.default_rng(2)
    core = CacheManagerCore(KNOWN, n_slots=6, policy=name, prefetch_budget=1)
    policy = core.policies[None]
    early = 0
    for step in range(300):
        if name == "flashmoe" and step % 7 == 0:
            policy.set_estimate(rng.random((3, L * E)) * 10)
        layer = step % L
        experts = rng.choice(E, size=2, replace=False).tolist()
        _, loads, _ = core.acquire(W, layer, experts, release_layers=[(layer - 1) % L])
        for load in loads:
            core.finish_load(load.key, ok=True)
        if step % 3 == 0:  # a prefetch of a later layer: resident, not used
            core.hint((layer + 1) % L, rng.choice(E, size=1).tolist())
            for load in core.issue_prefetches(1):
                core.finish_load(load.key, ok=True)
                assert policy.used_token[policy._index(load.key)] != policy.token
        if step % 5 == 0 and layer + 1 < L:  # another worker, ahead: used before its layer
            ahead = [k for k in core.slot_of if k[0] == layer + 1]
            if ahead:
                policy.on_hit(ahead[0])
                early += len(policy._early)
        assert np.allclose(policy.scores() - policy._d[policy.layer], policy._est)
    assert early > 0


def test_the_kept_variant_follows_the_estimate_s_step():
    """With step numbers, estimates for a past step, this step and the next one arrive in any
    order: the kept variants still equal scores()' choice."""
    rng = np.random.default_rng(5)
    core = CacheManagerCore(KNOWN, n_slots=6, policy="flashmoe")
    policy = core.policies[None]
    lags = set()
    for request in range(600):
        step, layer = divmod(request, L)
        if rng.random() < 0.3:
            core.set_estimate(rng.random((5, L * E)) * 10, step=step + int(rng.integers(-3, 2)))
        experts = rng.choice(E, size=2, replace=False).tolist()
        _, loads, _ = core.acquire(W, layer, experts, release_layers=[(layer - 1) % L],
                                   step=step)
        for load in loads:
            core.finish_load(load.key, ok=True)
        if request % 5 == 0 and layer + 1 < L:  # used before its layer (another worker)
            ahead = [k for k in core.slot_of if k[0] == layer + 1]
            if ahead:
                policy.on_hit(ahead[0])
        lags.add(policy.lag())
        assert np.allclose(policy.scores() - policy._d[policy.layer], policy._est)
    assert {-1, 0, 1, 2, 3} <= lags


def test_an_estimate_for_a_past_step_is_read_from_that_step_s_outcome():
    """A token's first layers run before its estimate arrives: the estimate in hand is the
    previous step's. An expert then takes the variant of that step's outcome (var 2: used
    then, var 1: not), or once this token visited its layer without using it, var 3 or 4
    (the same, given that); the estimate for this step, once it comes, gives the unvisited
    layers var 0 again. Without step numbers the policy takes any estimate as this
    token's."""
    core = CacheManagerCore(KNOWN, n_slots=8, policy="flashmoe")
    policy = core.policies[None]
    S = np.stack([np.full(L * E, 10.0 * (v + 1)) for v in range(5)])
    for layer in range(L):  # step 0: expert 0 of every layer used
        core.acquire(W, layer, [0], step=0)
    core.set_estimate(S, step=0)  # (late: step 0 has run)
    core.acquire(W, 0, [1], release_layers=[2], step=1)  # step 1 begins, no estimate for it
    assert policy.lag() == 1
    used_then, not_used = policy._index((2, 0)), policy._index((2, 1))
    assert policy._est[used_then] == 30.0 and policy._est[not_used] == 20.0
    assert policy._est[policy._index((0, 0))] == 40.0  # layer 0 visited, (0,0) not used
    assert policy._est[policy._index((0, 2))] == 50.0  # nor used in step 0
    assert policy._est[policy._index((0, 1))] == 30.0  # used in step 1
    core.acquire(W, 1, [1], release_layers=[0], step=1)
    assert policy._est[policy._index((1, 0))] == 40.0
    core.set_estimate(S, step=1)  # this step's own estimate
    assert policy.lag() == 0
    assert policy._est[used_then] == 10.0  # layer 2 not visited yet in step 1: var 0
    assert policy._est[policy._index((1, 0))] == 20.0  # visited, not used in step 1: var 1
    assert policy._est[policy._index((1, 1))] == 30.0  # used in step 1: var 2
    core.set_estimate(S, step=2)  # the next step's, before it began: var 0 for all
    assert policy.lag() == -1 and (policy._est == 10.0).all()
    core.acquire(W, 0, [2], release_layers=[1], step=2)
    assert policy.lag() == 0 and policy._est[used_then] == 10.0
    core.set_estimate(S, step=900)  # numbering from another run: taken as this step's
    assert policy.lag() == 0

    plain = CacheManagerCore(KNOWN, n_slots=8, policy="flashmoe")
    for layer in range(L):
        plain.acquire(W, layer, [0])
    plain.set_estimate(S)
    plain.acquire(W, 0, [1], release_layers=[2])
    assert plain.policies[None].lag() == 0
    assert plain.policies[None]._est[used_then] == 10.0


def test_a_step_number_tells_a_new_token_from_a_repeated_layer():
    """With step numbers, acquiring a layer again within one step (a retry) stays in that
    token; without them a layer at or before the last one starts a token."""
    core = CacheManagerCore(KNOWN, n_slots=8, policy="flashmoe")
    policy = core.policies[None]
    core.acquire(W, 0, [0], step=4)
    core.acquire(W, 0, [0], step=4)
    assert policy.token == 0 and policy.step == 4
    core.acquire(W, 0, [0], step=5)
    assert policy.token == 1
    core.acquire(W, 0, [0])
    assert policy.token == 2 and policy.step is None


def test_look_ahead_prefetch_takes_what_the_estimate_needs_sooner_than_its_victim():
    """FlashMoE's look-ahead prefetch hints a non-resident expert only when the estimate
    expects it sooner (by the margin) than the best victim, only while no demand load is in
    flight, and never without a usable estimate."""
    core = CacheManagerCore(KNOWN, n_slots=4, policy="flashmoe", prefetch_budget=2)
    policy = core.policies[None]
    run_tokens(core, [[[0, 1], [0], [0]]])  # full: (0,0) (0,1) (1,0) (2,0)
    assert core.learned_hints(1, 0.0) == 0  # no estimate yet: LRU fallback, no look-ahead
    S = np.full((3, L * E), 100.0)
    S[:, 2 * E + 3] = 0.0  # (2,3): needed at once
    policy.set_estimate(S)
    # At layer 0 of a new token: (2,3) is 1 layer step + 0 away, every resident ~100 further.
    _, loads, _ = core.acquire(W, 0, [0, 1], release_layers=[2])
    assert not loads
    assert core.learned_hints(1, margin=400.0) == 0  # not sooner by that many tokens
    assert core.learned_hints(1, margin=3.0) == 1
    assert list(core.pending_hints) == [(2, 3)]
    (load,) = core.issue_prefetches(1)
    assert load.key == (2, 3) and load.prefetch
    # Resident (loading), and not counted as used: a wrong guess is not kept as needed.
    assert policy.resident[2 * E + 3] and policy.used_token[2 * E + 3] != policy.token
    core.finish_load(load.key, ok=True)
    # A demand load in flight: the disk is busy, no look-ahead.
    S[:, 1 * E + 2] = 0.0
    policy.set_estimate(S)
    _, loads, _ = core.acquire(W, 1, [3], release_layers=[0])
    assert loads and core.learned_hints(1, 3.0) == 0
    core.finish_load(loads[0].key, ok=True)
    assert core.stats["prefetch_learned"] == 1


def test_look_ahead_prefetch_wants_a_fraction_of_the_victim_s_wait_and_skips_the_next_layers():
    """The look-ahead's other two rules: the candidate's expected next use at most 1/ratio of
    the victim's, and none of the next ``skip`` layers (their reads would land late)."""
    core = CacheManagerCore(KNOWN, n_slots=4, policy="flashmoe", prefetch_budget=2)
    policy = core.policies[None]
    run_tokens(core, [[[0, 1], [0], [0]]])  # full: (0,0) (0,1) (1,0) (2,0)
    S = np.full((3, L * E), 100.0)
    S[:, 1 * E + 3] = S[:, 2 * E + 3] = 0.0  # (1,3) next layer, (2,3) the one after
    policy.set_estimate(S)
    core.acquire(W, 0, [0, 1], release_layers=[2])
    # The best victim waits 100-odd layer steps; (2,3) one.
    assert core.learned_hints(1, ratio=1000.0, skip=1) == 0
    assert core.learned_hints(1, ratio=50.0, skip=2) == 0  # (2,3) is in the next two layers
    assert core.learned_hints(2, ratio=50.0, skip=1) == 1
    assert list(core.pending_hints) == [(2, 3)]
    core.pending_hints.clear()
    assert core.learned_hints(2, ratio=50.0, skip=0) == 2
    assert list(core.pending_hints) == [(1, 3), (2, 3)]  # soonest needed first


def test_the_inline_prefetcher_stands_down_while_the_look_ahead_can_run():
    """``look_ahead_ready``: a budget, global scope, a usable estimate and a full cache (the
    callers then keep the inline prefetcher's hints back unless
    ``prefetch.inline_with_learned``)."""
    core = CacheManagerCore(KNOWN, n_slots=4, policy="flashmoe", prefetch_budget=2)
    core.set_estimate(np.zeros((3, L * E)))
    run_tokens(core, [[[0, 1], [0]]])
    assert not core.look_ahead_ready()  # 3 of 4 slots: the cache still fills
    core.set_estimate(None)
    run_tokens(core, [[[0, 1], [0], [0]]])  # full
    assert not core.look_ahead_ready()  # no estimate
    core.set_estimate(np.zeros((3, L * E)))
    assert core.look_ahead_ready()
    core.set_estimate(None)  # fallback to LRU
    assert not core.look_ahead_ready()
    assert not CacheManagerCore(KNOWN, n_slots=4, policy="lru",
                                prefetch_budget=2).look_ahead_ready()
    core = CacheManagerCore(KNOWN, n_slots=4, policy="flashmoe")  # no prefetch budget
    core.set_estimate(np.zeros((3, L * E)))
    assert not core.look_ahead_ready()


def test_look_ahead_prefetch_stays_off_in_layer_scope():
    """A layer's own policy sees only that layer's requests, not where the token is now: the
    look-ahead (which ranks by layer steps from now) runs in global scope only."""
    core = CacheManagerCore(KNOWN, n_slots=6, policy="flashmoe", scope="layer",
                            prefetch_budget=4)
    run_tokens(core, [[[0, 1], [0, 1], [0, 1]]])  # two slots a layer, all full
    S = np.full((3, L * E), 100.0)
    S[:, 2 * E + 3] = 0.0  # (2,3): needed at once
    core.set_estimate(S)
    core.acquire(W, 0, [0, 1], release_layers=[2])
    assert core.learned_hints(3, margin=3.0) == 0 and not core.pending_hints


def test_estimates_used_counts_the_evictions_decided_on_an_estimate():
    """``estimates_used``: evictions that FlashMoE chose on a learned estimate; in its LRU
    fallback (no estimate, or one withdrawn) and under other policies it stays put."""
    tokens = [[[0, 1], [0, 1], [0, 1]], [[2, 3], [2, 3], [2, 3]]]
    cold = CacheManagerCore(KNOWN, n_slots=4, policy="flashmoe")
    run_tokens(cold, tokens)
    assert cold.stats["n_evict"] > 0 and cold.stats["estimates_used"] == 0
    lru = CacheManagerCore(KNOWN, n_slots=4, policy="lru")
    run_tokens(lru, tokens)
    assert lru.stats["n_evict"] > 0 and lru.stats["estimates_used"] == 0

    core = CacheManagerCore(KNOWN, n_slots=4, policy="flashmoe")
    core.set_estimate(np.zeros((3, L * E)))
    run_tokens(core, tokens[:1])  # 6 experts into 4 slots: 2 evictions on the estimate
    assert core.stats["n_evict"] == 2 and core.stats["estimates_used"] == 2
    core.set_estimate(None)  # withdrawn: LRU again
    run_tokens(core, tokens[1:])
    assert core.stats["n_evict"] > 2 and core.stats["estimates_used"] == 2
