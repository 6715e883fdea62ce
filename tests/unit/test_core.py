"""The cache manager's decision core, in-process: states, pins, waiters, prefetch."""

import pytest

from services.cache_manager.core import AcquireFailed, CacheManagerCore
from services.cache_manager.policies import POLICIES, PolicyError, make_policy, needs_future
from services.cache_manager.policies.lru import LRUPolicy

KNOWN = {(layer, expert): 1000 + expert for layer in range(2) for expert in range(8)}
W1, W2 = b"w1", b"w2"


def make(n_slots, **kw):
    return CacheManagerCore(KNOWN, n_slots=n_slots, **kw)


def acquire_loaded(core, worker, layer, experts, release_layers=()):
    """Acquire and complete every load at once (an instant disk)."""
    slots, loads, waiter = core.acquire(worker, layer, experts, release_layers)
    done = []
    for load in loads:
        done += core.finish_load(load.key, ok=True)
    assert (waiter is None) == (not loads) or waiter in done
    return slots, loads


def test_misses_then_hits_and_lru_victim():
    core = make(3)
    a, loads = acquire_loaded(core, W1, 0, [0, 1])
    assert len(loads) == 2 and core.stats["n_miss"] == 2
    acquire_loaded(core, W1, 0, [2], release_layers=[0])
    slots, loads, waiter = core.acquire(W1, 0, [1])  # hit; refreshes expert 1
    assert not loads and waiter is None and slots == [a[1]] and core.stats["n_hit"] == 1
    d, _ = acquire_loaded(core, W1, 1, [3], release_layers=[0])  # evicts the LRU: (0, 0)
    assert d == [a[0]] and (0, 0) not in core.slot_of and core.stats["n_evict"] == 1


def test_pins_are_per_worker_and_layer():
    core = make(4)
    acquire_loaded(core, W1, 0, [0, 1])
    acquire_loaded(core, W1, 1, [0, 1])  # layer 0 still held: two layers' pins at once
    assert set(core.pinned_by(W1)) == {0, 1}
    with pytest.raises(AcquireFailed) as info:  # all four slots pinned by W1's two layers
        core.acquire(W2, 0, [5])
    assert info.value.code == "no_free_slot"
    acquire_loaded(core, W1, 1, [2], release_layers=[0])  # drops layer 0, replaces layer 1
    assert core.pinned_by(W1) == {1: [(1, 2)]}
    acquire_loaded(core, W2, 0, [5])  # now there is an unpinned victim
    core.release(W1)
    assert core.pinned_by(W1) == {} and set(core.hold) == {(0, 5)}


def test_loading_expert_is_loaded_once_and_waited_on():
    core = make(4)
    inserts = []
    policy = core.policies[None]
    original = policy.on_insert
    policy.on_insert = lambda key: (inserts.append(key), original(key))
    slots1, loads1, waiter1 = core.acquire(W1, 0, [0, 1])
    slots2, loads2, waiter2 = core.acquire(W2, 0, [1, 2])  # (0,1) is loading: wait on it
    assert [l.key for l in loads1] == [(0, 0), (0, 1)] and [l.key for l in loads2] == [(0, 2)]
    assert slots2[0] == slots1[1] and inserts.count((0, 1)) == 1
    assert core.stats["n_hit_loading"] == 1 and core.stats["n_miss"] == 4
    assert core.finish_load((0, 1), ok=True) == []  # both still miss something
    assert core.finish_load((0, 2), ok=True) == [waiter2] and waiter2.missing == 0
    assert core.finish_load((0, 0), ok=True) == [waiter1]
    assert core.stats["n_load"] == 3 and core.resident() == 3


def test_loading_experts_are_never_victims():
    core = make(2)
    core.acquire(W1, 0, [0])  # loading, pinned
    core.release(W1)  # unpinned but still loading
    slots, loads, _ = core.acquire(W2, 0, [1])
    with pytest.raises(AcquireFailed):  # (0,0) loading, (0,1) pinned: nothing to evict
        core.acquire(W2, 1, [2])
    core.finish_load((0, 0), ok=True)
    core.finish_load((0, 1), ok=True)
    acquire_loaded(core, W2, 1, [2])  # (0,0) is resident and unpinned now
    assert (0, 0) not in core.slot_of


def test_failed_load_fails_its_waiters_frees_the_slot_and_drops_their_pins():
    core = make(3)
    _, _, waiter1 = core.acquire(W1, 0, [0, 1])
    _, _, waiter2 = core.acquire(W2, 0, [1])
    failed = core.finish_load((0, 1), ok=False, code="checksum", message="bad block")
    assert failed == [waiter1, waiter2]
    assert all(w.error.code == "checksum" and w.error.experts == [1] for w in failed)
    assert core.pinned_by(W1) == {} and core.pinned_by(W2) == {}
    assert core.finish_load((0, 0), ok=True) == []  # waiter1 already failed
    assert (0, 1) not in core.slot_of and core.stats["n_load_failed"] == 1
    assert len(core.free_slots) == 2  # (0,1)'s slot back; (0,0) resident


def test_no_free_slot_rolls_back_the_request():
    core = make(2)
    acquire_loaded(core, W1, 0, [0])
    with pytest.raises(AcquireFailed) as info:
        core.acquire(W2, 0, [1, 2, 3])  # one free slot, then (0,0) is pinned
    assert info.value.code == "no_free_slot"
    assert set(core.slot_of) == {(0, 0)} and not core.loading and core.pinned_by(W2) == {}
    core.release(W1)
    slots, _ = acquire_loaded(core, W2, 0, [2, 3])
    assert sorted(slots) == [0, 1]


def test_duplicates_and_unknown_experts():
    core = make(4)
    slots, loads, _ = core.acquire(W1, 0, [5, 5])
    assert len(loads) == 1 and slots[0] == slots[1]
    with pytest.raises(AcquireFailed) as info:
        core.acquire(W1, 0, [1, 99])
    assert info.value.code == "unknown_expert" and info.value.experts == [99]


def prefetch(core, layer, experts, max_loads):
    core.hint(layer, experts)
    return core.issue_prefetches(max_loads)


def test_prefetch_budget_depth_and_accounting():
    core = make(6, prefetch_budget=2, prefetch_window=4)
    loads = prefetch(core, 0, [0, 1, 2, 3], max_loads=8)
    assert [l.key for l in loads] == [(0, 0), (0, 1)]  # the budget: two in flight
    assert list(core.pending_hints) == [(0, 2), (0, 3)]  # kept until there is room
    assert core.issue_prefetches(8) == []
    core.finish_load((0, 0), ok=True)
    assert core.issue_prefetches(max_loads=0) == []  # no free queue depth
    # (0,0) is resident: not queued; (0,2) is hinted again, so (0,3) is now the oldest
    assert [l.key for l in prefetch(core, 0, [0, 2], max_loads=1)] == [(0, 3)]
    assert core.issue_prefetches(8) == []  # the budget again
    core.finish_load((0, 1), ok=True)
    assert [l.key for l in core.issue_prefetches(8)] == [(0, 2)]
    # (0,3) still loading: a request waits on it (a late prefetch); both count as used
    _, _, waiter = core.acquire(W1, 0, [0, 3])
    assert core.stats["n_hit"] == 1 and core.stats["n_hit_loading"] == 1
    assert core.finish_load((0, 3), ok=True) == [waiter]
    core.finish_load((0, 2), ok=True)
    assert core.stats["prefetch_issued"] == 4 and core.stats["prefetch_used"] == 2
    assert core.stats["prefetch_bytes"] == 1000 + 1001 + 1002 + 1003
    assert core.stats["prefetch_used_bytes"] == 1000 + 1003
    core.release(W1)
    for expert in range(4, 8):  # push the unused (0,1) and (0,2) out
        acquire_loaded(core, W1, 1, [expert], release_layers=[1])
    assert core.stats["prefetch_wasted"] == 2
    assert core.stats["prefetch_wasted_bytes"] == 1001 + 1002


def test_pending_hints_are_bounded_by_the_window_and_skip_what_is_there():
    core = make(6, prefetch_budget=1, prefetch_window=3)
    acquire_loaded(core, W1, 1, [0])
    core.hint(1, [0, 1, 2, 3, 4])  # (1,0) is resident: never queued
    assert list(core.pending_hints) == [(1, 2), (1, 3), (1, 4)]
    assert core.stats["prefetch_dropped"] == 1
    acquire_loaded(core, W1, 1, [2, 3])  # loaded on demand meanwhile
    assert [l.key for l in core.issue_prefetches(8)] == [(1, 4)]
    assert not core.pending_hints


def test_drop_worker_releases_pins_and_cancels_its_requests():
    core = make(3)
    acquire_loaded(core, W1, 0, [0, 1])
    _, _, waiter = core.acquire(W1, 1, [2])
    assert core.drop_worker(W1) == 1
    assert core.pinned_keys() == set() and waiter.error.code == "worker_gone"
    assert core.finish_load((1, 2), ok=True) == []  # nobody to answer


def test_layer_scope_gives_each_layer_its_own_budget():
    core = make(4, scope="layer")
    acquire_loaded(core, W1, 0, [0, 1])
    acquire_loaded(core, W1, 1, [0, 1], release_layers=[0])
    acquire_loaded(core, W1, 0, [2], release_layers=[1])  # layer 0 full: evicts in layer 0
    assert {(1, 0), (1, 1), (0, 1), (0, 2)} == set(core.slot_of)


def test_oracle_policies_only_in_the_simulator():
    with pytest.raises(PolicyError, match="future"):
        make(4, policy="belady")
    assert make(4, policy="belady", allow_oracle=True).policy_name == "belady"


def test_registry_builds_every_policy_and_rejects_unknown():
    for name in POLICIES:
        policy = make_policy(name, 4)
        policy.configure([0], 4)
        if needs_future(name):
            policy.set_next_use(7)
        policy.on_request(0)
        policy.on_insert((0, 1))
        assert (0, 1) in policy and policy.victim() == (0, 1)
    with pytest.raises(PolicyError, match="unknown policy"):
        make_policy("nope", 4)
    with pytest.raises(PolicyError, match="unknown parameter"):
        make_policy("lru", 4, {"ghost": 1})
    with pytest.raises(PolicyError, match="capacity"):
        make_policy("lru", 0)
    assert isinstance(make(4).policies[None], LRUPolicy)


def test_capacity_goes_down_to_what_pins_hold_and_back_up_to_the_arena():
    core = make(6)
    acquire_loaded(core, b"a", 0, [0, 1])  # pinned by a
    acquire_loaded(core, b"b", 1, [0, 1, 2, 3])
    core.release(b"b")
    with pytest.raises(PolicyError, match="go down to 2"):
        core.set_capacity(1)
    with pytest.raises(PolicyError, match="arena has 6 slots"):
        core.set_capacity(7)
    core.set_capacity(3, check=True)
    assert core.capacity == 6 and core.resident() == 6  # a check changes nothing
    core.set_capacity(3)
    assert core.capacity == 3 and core.resident() == 3 and core.stats["n_evict"] == 3
    assert {(0, 0), (0, 1)} <= set(core.slot_of)  # the pinned experts stayed
    acquire_loaded(core, b"b", 1, [4])  # full at 3: a miss evicts, never takes a 4th slot
    assert core.resident() == 3 and core.gauges()["capacity"] == 3
    core.set_capacity(6)
    acquire_loaded(core, b"b", 1, [5, 6])
    assert core.resident() == 5


def test_policy_params_change_live_and_a_bad_one_changes_nothing():
    core = make(4, policy="flashmoe")
    core.set_policy("flashmoe", {"hybrid_share": 0.5})
    assert '"hybrid_share": 0.5' in core.policy_params_json()
    with pytest.raises(PolicyError):
        core.check_policy("flashmoe", {"no_such": 1})
    assert '"hybrid_share": 0.5' in core.policy_params_json()
