"""The cache manager's decision core, in-process."""

import pytest

from services.cache_manager.core import AcquireFailed, CacheManagerCore
from services.cache_manager.policies import POLICIES, PolicyError, make_policy, needs_future

KNOWN = {(layer, expert) for layer in range(2) for expert in range(8)}
W1, W2 = b"w1", b"w2"


def load_all(core, plan):
    for key, slot in plan.loads:
        core.finish_load(key, slot, ok=True)
    return plan


def test_misses_then_hits_and_lru_victim():
    core = CacheManagerCore(KNOWN, n_slots=3)
    a = load_all(core, core.acquire(W1, 0, [0, 1]))
    assert len(a.loads) == 2 and core.stats["n_miss"] == 2
    b = load_all(core, core.acquire(W1, 0, [2]))
    assert len(b.loads) == 1
    c = core.acquire(W1, 0, [1])  # hit; refreshes expert 1
    assert not c.loads and c.slots == [a.slots[1]] and core.stats["n_hit"] == 1
    d = load_all(core, core.acquire(W1, 0, [3]))  # evicts the LRU: expert 0
    assert d.slots == [a.slots[0]] and (0, 0) not in core.slot_of
    assert core.stats["n_evict"] == 1


def test_pinned_experts_are_never_victims():
    core = CacheManagerCore(KNOWN, n_slots=3)
    load_all(core, core.acquire(W1, 0, [0]))
    load_all(core, core.acquire(W2, 1, [0, 1]))  # W2 pins (1,0), (1,1); W1 still pins (0,0)
    plan = load_all(core, core.acquire(W2, 1, [2]))  # W2's old pins drop; LRU unpinned: (1,0)
    assert (0, 0) in core.slot_of and (1, 0) not in core.slot_of and len(plan.loads) == 1


def test_all_pinned_gives_no_free_slot_and_leaves_state_consistent():
    core = CacheManagerCore(KNOWN, n_slots=2)
    load_all(core, core.acquire(W1, 0, [0, 1]))
    with pytest.raises(AcquireFailed) as info:
        core.acquire(W2, 0, [2])
    assert info.value.code == "no_free_slot"
    core.release(W1)
    plan = load_all(core, core.acquire(W2, 0, [2, 3]))
    assert sorted(plan.slots) == [0, 1]


def test_duplicates_and_unknown_experts():
    core = CacheManagerCore(KNOWN, n_slots=4)
    plan = core.acquire(W1, 0, [5, 5])
    assert len(plan.loads) == 1 and plan.slots[0] == plan.slots[1]
    with pytest.raises(AcquireFailed) as info:
        core.acquire(W1, 0, [1, 99])
    assert info.value.code == "unknown_expert" and info.value.experts == [99]


def test_failed_load_frees_the_slot():
    core = CacheManagerCore(KNOWN, n_slots=1)
    plan = core.acquire(W1, 0, [0])
    core.finish_load(*plan.loads[0], ok=False)
    core.release(W1)
    assert core.resident() == 0 and core.stats["n_load_failed"] == 1
    plan = load_all(core, core.acquire(W1, 0, [1]))
    assert plan.slots == [0]


def test_layer_scope_gives_each_layer_its_own_budget():
    core = CacheManagerCore(KNOWN, n_slots=4, scope="layer")
    load_all(core, core.acquire(W1, 0, [0, 1]))
    core.release(W1)
    load_all(core, core.acquire(W1, 1, [0, 1]))
    core.release(W1)
    load_all(core, core.acquire(W1, 0, [2]))  # layer 0 full: evicts in layer 0 only
    assert {(1, 0), (1, 1), (0, 1), (0, 2)} == set(core.slot_of)


def test_registry_builds_every_policy_and_rejects_unknown():
    for name in POLICIES:
        policy = make_policy(name, 4)
        if needs_future(name):
            policy.set_next_use(7)
        policy.on_insert("a")
        assert "a" in policy and policy.victim() == "a"
    with pytest.raises(PolicyError, match="unknown policy"):
        make_policy("nope", 4)
    with pytest.raises(PolicyError, match="unknown parameter"):
        make_policy("lru", 4, {"ghost": 1})
    with pytest.raises(PolicyError, match="capacity"):
        make_policy("lru", 0)
