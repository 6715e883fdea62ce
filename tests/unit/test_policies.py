"""Eviction policies: the shared protocol, pins, parameters, and hand-worked examples."""

import random

import pytest

from services.cache_manager.core import CacheManagerCore
from services.cache_manager.policies import (POLICIES, PolicyError, make_policy, needs_core,
                                             needs_future)

# Policies the plain per-request protocol can drive (the layer-aware ones need the core's
# layer order: tests/unit/test_scored_policies.py).
REQUEST_POLICIES = sorted(name for name in POLICIES if not needs_core(name))
from services.cache_manager.policies.base import EvictionPolicy
from services.cache_manager.policies.belady import NEVER


def skewed_trace(n=4000, keys=40, seed=0):
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(keys)]
    return rng.choices(range(keys), weights=weights, k=n)


def next_uses(trace):
    nxt, seen = [NEVER] * len(trace), {}
    for i in range(len(trace) - 1, -1, -1):
        nxt[i] = seen.get(trace[i], NEVER)
        seen[trace[i]] = i
    return nxt


def run(policy, trace, via_protocol=False, pinned_every=0, rng=None):
    """Replay; optionally through the base-class protocol, optionally with random pins."""
    nus = next_uses(trace)
    hits = []
    for i, key in enumerate(trace):
        if needs_future(policy.name):
            policy.set_next_use(nus[i])
        pinned = frozenset()
        if pinned_every and i % pinned_every == 0 and len(policy) > 1:
            pinned = frozenset(rng.sample(sorted(_resident(policy, trace)), k=len(policy) // 2))
        request = EvictionPolicy.request if via_protocol or pinned else type(policy).request
        if pinned:
            before = _resident(policy, trace)
            hit = request(policy, key, pinned)
            assert pinned & before <= _resident(policy, trace) | {key}, \
                f"{policy.name} evicted a pinned key"
        else:
            hit = request(policy, key)
        hits.append(hit)
        assert len(policy) <= policy.capacity
    return hits


def _resident(policy, trace):
    return {k for k in set(trace) if k in policy}


@pytest.mark.parametrize("name", REQUEST_POLICIES)
def test_every_policy_builds_and_respects_capacity(name):
    for capacity in (1, 2, 7, 32):
        hits = run(make_policy(name, capacity), skewed_trace(1500))
        assert 0 < sum(hits) < len(hits)


@pytest.mark.parametrize("name", REQUEST_POLICIES)
def test_fused_request_matches_the_step_by_step_protocol(name):
    trace = skewed_trace(5000, keys=60, seed=3)
    for capacity in (3, 16):
        assert run(make_policy(name, capacity), trace) == \
            run(make_policy(name, capacity), trace, via_protocol=True)


@pytest.mark.parametrize("name", REQUEST_POLICIES)
def test_pinned_keys_are_never_victims(name):
    rng = random.Random(5)
    run(make_policy(name, 8), skewed_trace(3000, keys=30, seed=9), pinned_every=3, rng=rng)


@pytest.mark.parametrize("name", REQUEST_POLICIES)
@pytest.mark.parametrize("via_protocol", [False, True])
def test_request_with_every_resident_key_pinned_is_a_policy_error(name, via_protocol):
    policy = make_policy(name, 2)
    request = EvictionPolicy.request if via_protocol else type(policy).request
    for key, next_use in ((1, 10), (2, 11), (3, 12)):
        if needs_future(name):
            policy.set_next_use(next_use)
        if key == 3:
            assert policy.victim(frozenset({1, 2})) is None
            with pytest.raises(PolicyError, match=f"{name}: every resident key is pinned"):
                request(policy, key, frozenset({1, 2}))
        else:
            request(policy, key)
    assert 1 in policy and 2 in policy and 3 not in policy and len(policy) == 2


def test_belady_is_an_upper_bound_on_these_traces():
    for seed in range(3):
        trace = skewed_trace(3000, keys=50, seed=seed)
        for capacity in (4, 12):
            best = sum(run(make_policy("belady", capacity), trace))
            for name in REQUEST_POLICIES:
                assert sum(run(make_policy(name, capacity), trace)) <= best, name


def test_belady_without_future_is_refused():
    policy = make_policy("belady", 2)
    with pytest.raises(PolicyError, match="set_next_use"):
        policy.request(1)
    with pytest.raises(PolicyError, match="needs future knowledge"):
        CacheManagerCore({(0, 0): 1}, n_slots=2, policy="belady")


def test_parameters_are_typed_checked_and_unknown_keys_rejected():
    assert make_policy("s3fifo", 20, {"small_ratio": "0.2"}).small_capacity == 4
    assert make_policy("lirs", 200, {"hir_ratio": 0.05}).hir_capacity == 10
    with pytest.raises(PolicyError, match="unknown parameter.*allowed: small_ratio"):
        make_policy("s3fifo", 20, {"small": 0.2})
    with pytest.raises(PolicyError, match="allowed: none"):
        make_policy("arc", 20, {"p": 1})
    with pytest.raises(PolicyError, match="hir_ratio"):
        make_policy("lirs", 20, {"hir_ratio": 1.5})
    with pytest.raises(PolicyError, match="bad parameter value"):
        make_policy("s3fifo", 20, {"move_to_main_threshold": "two"})


def test_lru_fifo_and_sieve_small_examples():
    trace = [1, 2, 3, 1, 4, 1, 2, 5, 1, 3]
    #          LRU c=3: hit on 1 (step 4), 1 (step 6), 1 (step 9)
    assert run(make_policy("lru", 3), trace) == [0, 0, 0, 1, 0, 1, 0, 0, 1, 0]
    # FIFO c=3: 4 evicts 1, so the 1 at step 6 misses and evicts 2; 2 misses, evicts 3 ...
    assert run(make_policy("fifo", 3), trace) == [0, 0, 0, 1, 0, 0, 0, 0, 1, 0]
    # SIEVE c=3: 1 is visited at step 4; 4 passes over it (clearing) and evicts 2; 1 hits;
    # 2 evicts 3; 5 starts at the hand (4)... see sieve.py.
    assert run(make_policy("sieve", 3), trace) == [0, 0, 0, 1, 0, 1, 0, 0, 1, 0]


def car_state(car):
    return ([(k, int(r)) for k, r in car.t1.items()], [(k, int(r)) for k, r in car.t2.items()],
            list(car.b1), list(car.b2), car.p)


def test_car_follows_the_paper_on_a_hand_worked_example():
    """Bansal & Modha FAST'04, Figure 2, worked by hand with c = 2 (see car.py)."""
    car = make_policy("car", 2)
    expected = {
        # step: (hit, T1 head->tail (key, ref), T2 head->tail, B1 LRU->MRU, B2 LRU->MRU, p)
        1: (False, [(1, 0)], [], [], [], 0),
        2: (False, [(1, 0), (2, 0)], [], [], [], 0),
        3: (True, [(1, 1), (2, 0)], [], [], [], 0),
        # replace(): 1 has its bit set -> moves to T2 with bit cleared; 2 is demoted to B1
        4: (False, [(3, 0)], [(1, 0)], [2], [], 0),
        # 2 is in B1: replace() demotes 3 (|T1| >= max(1, p)), then p = 0 + max(1, 0/2) = 1
        5: (False, [], [(1, 0), (2, 0)], [3], [], 1),
        # |T1| = 0 < max(1, p): the T2 hand demotes 1 to B2
        6: (False, [(4, 0)], [(2, 0)], [3], [1], 1),
        # 1 is in B2: replace() demotes 4 to B1; p = max(1 - max(1, 2/1), 0) = 0
        7: (False, [], [(2, 0), (1, 0)], [3, 4], [], 0),
        8: (True, [], [(2, 1), (1, 0)], [3, 4], [], 0),
        # T2 hand: 2's bit is cleared and it goes round; 1 is demoted to B2;
        # then |T1| + |B1| = c: the LRU of B1 (3) is discarded
        9: (False, [(5, 0)], [(2, 0)], [4], [1], 0),
        10: (False, [(3, 0)], [(2, 0)], [5], [1], 0),
    }
    trace = [1, 2, 1, 3, 2, 4, 1, 2, 5, 3]
    for step, key in enumerate(trace, 1):
        hit = car.request(key)
        want_hit, *want_state = expected[step]
        assert hit == want_hit, f"step {step}"
        assert car_state(car) == tuple(want_state), f"step {step}: {car_state(car)}"


def test_arc_adapts_p_on_ghost_hits():
    arc = make_policy("arc", 2)
    for key in [1, 2, 1, 3]:  # 1 is promoted to T2; 3's REPLACE moves T1's LRU (2) to B1
        arc.request(key)
    assert list(arc.t1) == [3] and list(arc.t2) == [1] and list(arc.b1) == [2] and arc.p == 0
    # Ghost hit in B1: p += max(|B2|/|B1|, 1) = 1; REPLACE: |T1| = p, x not in B2 -> T2's LRU
    assert arc.request(2) is False
    assert arc.p == 1 and list(arc.t2) == [2] and list(arc.b2) == [1] and list(arc.t1) == [3]


def test_car_falls_back_to_the_other_clock_when_pins_block_its_choice():
    from services.cache_manager.policies.car import CARPolicy

    car = CARPolicy(4)
    for key in "abcd":
        car.on_miss(key)
        car.on_insert(key)
    car.t2["e"] = False  # state as found in a replay: T1 below p, T2 entirely pinned
    del car.t1["d"]
    car.p = 4.0
    assert car.victim(pinned={"e"}) == "a"
    assert car.victim(pinned={"a", "b", "c", "e"}) is None
