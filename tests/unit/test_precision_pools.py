"""The arena by precision: its layout, reads into slots of several units, the core's pools
(dynamic: chosen by the learned estimate; random: drawn) and their bookkeeping."""

import numpy as np
import pytest

from common.arena import ArenaLayout, Pool, plan_layout, plan_pools, pool_fractions
from common.store import READ_OP_DTYPE
from services.cache_manager.core import CacheManagerCore
from services.cache_manager.loads import split_at_units
from services.cache_manager.policies import PolicyError
from services.cache_manager.policies.scored import VARIANTS

L, E = 2, 8
SIZES = {(layer, e): 1000 for layer in range(L) for e in range(E)}
POOLS = [("native", [0]), ("int8", [1, 3]), ("int4", [5, 6, 7, 8])]


def core(precision="dynamic", policy="flashmoe", **kw):
    kw.setdefault("upgrades_per_token", 4)
    return CacheManagerCore(SIZES, 9, policy, pools=POOLS, precision=precision,
                            pool_bytes={"int8": 500, "int4": 250}, **kw)


def estimate(hot: dict[tuple[int, int], float], cold: float = 40.0) -> np.ndarray:
    S = np.full((VARIANTS, L * E), cold)
    for (layer, e), value in hot.items():
        S[:, layer * E + e] = value
    return S


def test_a_read_crossing_units_is_cut_at_the_boundary():
    ops = np.zeros(3, dtype=READ_OP_DTYPE)
    unit = 3 * 4096
    for i in range(3):  # blocks of 8 KiB into a slot starting at unit 4
        ops[i] = (i % 2, 4, 100_000 + i * 8192, i * 8192, 8192, 0, 0, 0)
    out = split_at_units(ops, unit)
    # block 1 (8..16 KiB) crosses the first unit's end at 12 KiB
    assert [(int(o["buf_index"]), int(o["buf_offset"]), int(o["length"]),
             int(o["file_offset"])) for o in out] == [
        (4, 0, 8192, 100_000), (4, 8192, 4096, 108_192), (5, 0, 4096, 112_288),
        (5, 4096, 8192, 116_384)]
    assert int(out["length"].sum()) == 3 * 8192


def test_layout_round_trips_the_wire_and_names_each_slots_precision():
    layout = ArenaLayout(4096, (Pool("native", 0, 2, 4), Pool("int8", 8, 3, 2),
                                Pool("int4", 14, 5, 1)))
    assert layout.n_units == 19
    again = ArenaLayout.from_wire(4096, 19, layout.to_wire())
    assert again == layout
    assert [layout.pool_of(s).precision for s in (0, 4, 8, 10, 12, 14, 18)] == \
        ["native"] * 2 + ["int8"] * 3 + ["int4"] * 2
    with pytest.raises(IndexError):
        layout.pool_of(2)  # inside a native slot, not one
    with pytest.raises(ValueError):
        ArenaLayout.from_wire(4096, 10, layout.to_wire())  # more units than the arena
    assert ArenaLayout.from_wire(4096, 7, []).pools == (Pool("native", 0, 7, 1),)


def test_plan_layout_keeps_the_budget_in_bytes(tmp_path):
    from flashmoe.tools.store_writer import write_copies
    from flashmoe.tools.synth_store import synth_store

    store = synth_store(tmp_path / "s", "gpt-oss-tiny", 0.5, show_progress=False)
    store.close()
    write_copies(store.path, ["int8", "int4"], show_progress=False)
    from common.store import ExpertStore

    with ExpertStore.open(store.path) as store:
        native = store.manifest.slot_bytes
        budget = 40 * native
        assert plan_layout(store, 40, "native") == \
            ArenaLayout(native, (Pool("native", 0, 40, 1),))
        for precision in ("int8", "int4"):
            layout = plan_layout(store, 40, precision)
            assert layout.unit_bytes == store.at(precision).manifest.slot_bytes < native
            assert layout.n_units * layout.unit_bytes <= budget
            assert layout.pools[0].n_slots > 40
        layout = plan_layout(store, 40, "dynamic", (0.2, 0.3, 0.5))
        assert [p.precision for p in layout.pools] == ["native", "int8", "int4"]
        assert layout.n_units * layout.unit_bytes <= budget
        assert layout.pools[2].units == 1 and layout.pools[0].units > layout.pools[1].units


def test_a_precision_given_no_share_of_the_budget_gets_no_pool():
    sizes = {"native": 4 * 4096, "int8": 2 * 4096, "int4": 4096}
    layout = plan_pools(sizes, 40, "dynamic", (0.0, 0.5, 0.5))
    assert [(p.precision, p.n_slots, p.units) for p in layout.pools] == \
        [("int8", 40, 2), ("int4", 80, 1)]
    assert layout.n_units * layout.unit_bytes <= 40 * sizes["native"]
    # random's fractions are given per precision and taken for the pools there are
    assert pool_fractions(layout, (5.0, 1.0, 3.0)) == (1.0, 3.0)
    assert pool_fractions(layout, None) == (40.0, 80.0)
    c = CacheManagerCore(SIZES, layout.n_units, "lru", precision="random",
                         pools=[(p.precision, list(p.slots())) for p in layout.pools],
                         pool_bytes={"int8": 500, "int4": 250},
                         fractions=pool_fractions(layout, (5.0, 1.0, 3.0)))
    slots, loads, _ = c.acquire("w", 0, list(range(8)))
    assert {c.precision_of(s) for s in slots} <= {"int8", "int4"}
    assert c.stats["n_load_int8"] + c.stats["n_load_int4"] == 8 and "n_load_native" not in c.stats


def test_dynamic_puts_an_expert_expected_soon_at_native_and_the_rest_lower():
    c = core()
    c.set_estimate(estimate({(0, 1): 0.5, (0, 2): 1.0}))
    # fill every pool: native first (room), then int8, then int4
    slots, loads, _ = c.acquire("w", 0, [1, 2, 3])
    assert [c.precision_of(s) for s in slots] == ["native", "int8", "int8"]
    for load in loads:
        c.finish_load(load.key, True)
    slots, loads, _ = c.acquire("w", 1, [0, 1, 2, 3], release_layers=[0])
    assert [c.precision_of(s) for s in slots] == ["int4"] * 4
    for load in loads:
        c.finish_load(load.key, True)
    c.release("w")
    # a cold miss goes to int4 (every better pool's residents are expected sooner) ...
    slots, loads, _ = c.acquire("w", 0, [4])
    assert c.precision_of(slots[0]) == "int4"
    assert loads[0].nbytes == 250
    c.finish_load((0, 4), True)
    # ... an expert expected soon evicts a later one of a better pool
    c.set_estimate(estimate({(0, 1): 0.5, (0, 2): 1.0, (0, 5): 0.7}))
    slots, loads, _ = c.acquire("w", 0, [5], release_layers=[0])
    assert c.precision_of(slots[0]) == "int8" and loads[0].nbytes == 500
    assert c.stats["n_load_native"] == 1 and c.stats["n_load_int8"] == 3
    assert c.stats["n_load_int4"] == 5
    # one bookkeeping: every slot in the arena is a slot of its pool, none twice
    held = list(c.slot_of.values())
    assert len(held) == len(set(held)) == 7
    assert all(c.precision_of(s) for s in held)


@pytest.mark.parametrize("weights, pools", [([0.9, 0.1], ["int8", "int4"]),
                                             ([0.1, 0.9], ["int4", "int8"])])
def test_dynamic_keeps_the_expert_of_larger_router_weight_at_the_better_precision(weights,
                                                                                  pools):
    """Two misses with the same estimate: the one carrying more of the token's routing goes
    to int8 (its expected next use over its share beats int8's worst resident), the other
    to int4; swapping the weights swaps the pools."""
    c = core(weight_power=1.0)
    c.set_estimate(estimate({(0, 1): 0.5, (0, 2): 1.0}))
    for layer, experts in ((0, [1, 2, 3]), (1, [0, 1, 2, 3])):  # every pool full
        _, loads, _ = c.acquire("w", layer, experts)
        for load in loads:
            c.finish_load(load.key, True)
        c.release("w")
    c.set_estimate(estimate({(0, 1): 0.5, (0, 2): 1.0, (0, 5): 30.0, (0, 6): 30.0}))
    slots, _, _ = c.acquire("w", 0, [5, 6], weights=weights)
    assert [c.precision_of(s) for s in slots] == pools


def test_dynamic_without_an_estimate_loads_at_the_lowest_precision():
    c = core()
    slots, _, _ = c.acquire("w", 0, [1, 2])
    assert [c.precision_of(s) for s in slots] == ["int4", "int4"]


def test_random_draws_each_loads_precision_with_its_fractions():
    c = core("random", "lru", fractions=(0.0, 0.0, 1.0))
    slots, _, _ = c.acquire("w", 0, [1, 2, 3])
    assert {c.precision_of(s) for s in slots} == {"int4"}
    c = core("random", "lru", fractions=(1.0, 0.0, 0.0))
    slots, _, _ = c.acquire("w", 0, [1])
    assert c.precision_of(slots[0]) == "native"


def test_pools_refuse_what_they_cannot_do():
    with pytest.raises(PolicyError, match="flashmoe"):
        core("dynamic", "lru")
    with pytest.raises(ValueError, match="global"):
        CacheManagerCore(SIZES, 9, "lru", pools=POOLS, precision="random", scope="layer")
    c = core("random", "lru")
    with pytest.raises(PolicyError, match="restart"):
        c.set_capacity(3)
    with pytest.raises(PolicyError, match="restart"):
        c.set_policy("lfu")


def test_a_failed_load_frees_its_slot_in_its_own_pool():
    c = core("random", "lru", fractions=(0.0, 1.0, 0.0))
    slots, loads, waiter = c.acquire("w", 0, [1])
    assert c.precision_of(slots[0]) == "int8"
    done = c.finish_load((0, 1), False, "io_error")
    assert done == [waiter] and waiter.error is not None
    assert slots[0] in c.pool_free[1] and (0, 1) not in c.slot_of


def test_an_upgrade_reads_a_hot_low_precision_expert_into_a_better_pool_while_idle():
    c = core(prefetch_budget=2)
    c.set_estimate(estimate({}))
    for layer in (0, 1):  # fill: native (0,0); int8 (0,1) (0,2); int4 the rest
        slots, loads, _ = c.acquire("w", layer, [0, 1, 2, 3], release_layers=[0, 1])
        for load in loads:
            c.finish_load(load.key, True)
    c.release("w")
    where = {key: c.precision_of(slot) for key, slot in c.slot_of.items()}
    low = next(key for key, p in where.items() if p == "int4")
    assert c.may_upgrade() and c.issue_prefetches(4) == []  # nothing expected sooner
    c.set_estimate(estimate({low: 0.1}))
    loads = c.issue_prefetches(4)
    assert [(load.key, load.upgrade, c.precision_of(load.slot)) for load in loads] == \
        [(low, True, "native")]
    old = c.slot_of[low]
    # a worker pins it meanwhile: served from the old slot until it lets go
    slots, new, _ = c.acquire("w", low[0], [low[1]])
    assert slots == [old] and new == []
    assert c.finish_load(low, True) == []
    assert c.slot_of[low] == old and c.stats["upgrades_done"] == 0
    c.release("w")
    assert c.precision_of(c.slot_of[low]) == "native" and c.stats["upgrades_done"] == 1
    assert old in c.pool_free[2]
    assert c.stats["n_load_native"] == 2 and c.prefetch_inflight == 0 and not c.hold
    held = list(c.slot_of.values())
    assert len(held) == len(set(held))
