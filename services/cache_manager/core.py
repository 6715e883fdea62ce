"""The cache manager's decision core: slot states, pins, waiting requests, prefetch, eviction.

Pure bookkeeping, no sockets, no IO and no clock, so that the live process and the trace
simulator (`flashmoe bench --mode core`) drive the same object.

Every expert slot is FREE, LOADING or RESIDENT:
  - ``acquire`` answers a worker's request for one layer's experts. Resident experts are hits;
    a missing one gets a slot (a victim chosen by the policy is evicted) and a ``Load`` that the
    caller must run; an expert already LOADING (a prefetch, or another worker's miss) is
    waited on, never loaded twice (it counts as a miss, and in ``n_hit_loading``). A request
    with anything still loading returns a ``Waiter`` that ``finish_load`` completes.
  - ``hint`` queues experts expected soon; ``issue_prefetches`` starts loads for them that
    nobody waits for, bounded by the prefetch budget and the free queue depth the caller
    passes in (call it again whenever depth frees up).
  - ``finish_load`` reports a load's outcome (after its checksum was verified) and returns the
    waiters it completed or failed.
A LOADING expert is in the policy from the start of its load (one ``on_insert`` per load) but
is never a victim; neither is a pinned one.

Pins are per (worker, layer): a request pins its experts until the worker releases that layer
(``release_layers`` of a later request, or ``release``), acquires the same layer again, or
goes away (``drop_worker``). A worker can so hold layer l while it acquires layer l+1.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Sequence

from .policies import EvictionPolicy, PolicyError, make_policy, needs_core, needs_future
from .pools import PrecisionPools

ExpertKey = tuple[int, int]  # (layer, expert)
Worker = Hashable  # a worker's identity (the ROUTER identity bytes in the live process)

STATS_KEYS = ("n_hit", "n_miss", "n_hit_loading", "n_evict", "n_load", "n_load_failed",
              "prefetch_issued", "prefetch_used", "prefetch_wasted", "prefetch_failed",
              "prefetch_dropped", "prefetch_learned", "prefetch_bad_skipped",
              "prefetch_bytes", "prefetch_used_bytes", "prefetch_wasted_bytes",
              "n_byte_loaded", "estimates_used")


class AcquireFailed(Exception):
    def __init__(self, code: str, message: str, experts: list[int]) -> None:
        super().__init__(message)
        self.code, self.experts = code, experts


@dataclass(eq=False)
class Waiter:
    """An acquire parked until every expert it needs is resident."""
    worker: Worker
    layer: int
    slots: list[int]
    tag: Any  # the caller's handle for the reply (identity and seq in the live process)
    pins: list  # the pin list this request made (dropped on failure unless replaced since)
    missing: int = 0  # loads still outstanding
    error: AcquireFailed | None = None  # set when one of its loads failed (or it was cancelled)


class Load:
    """One expert being read into its slot."""
    __slots__ = ("key", "slot", "nbytes", "prefetch", "waiters", "attempts", "upgrade")

    def __init__(self, key: ExpertKey, slot: int, nbytes: int, prefetch: bool) -> None:
        self.key, self.slot, self.nbytes, self.prefetch = key, slot, nbytes, prefetch
        self.upgrade = False  # a resident expert read again at a better precision
        self.waiters: list[Waiter] = []  # requests parked on it
        self.attempts = 1  # reads of it submitted (a failed read is retried, see loads.py)

    def __repr__(self) -> str:
        return f"Load({self.key}, slot={self.slot}, prefetch={self.prefetch})"


def _refuse_oracle(policy: str) -> None:
    """PolicyError for a policy that needs the future (only the trace simulator runs one)."""
    if needs_future(policy):
        raise PolicyError(f"policy {policy!r} needs future knowledge; only the trace "
                          f"simulator (`flashmoe bench`) can run it")


class CacheManagerCore(PrecisionPools):
    def __init__(self, expert_bytes: Mapping[ExpertKey, int], n_slots: int,
                 policy: str = "lru", policy_params: Mapping | None = None,
                 scope: str = "global", prefetch_budget: int = 0,
                 prefetch_window: int | None = None, allow_oracle: bool = False,
                 pools: list[tuple[str, list[int]]] | None = None,
                 pool_bytes: Mapping[str, int] | None = None, precision: str = "native",
                 fractions: tuple[float, ...] | None = None, seed: int = 0,
                 admit: float = 1.0, upgrades_per_token: int = 0,
                 weight_power: float = 0.0) -> None:
        """``expert_bytes``: every known expert and its size (for byte counters).
        ``pools``: the arena's slots by precision (``common.arena.ArenaLayout``), best
        precision first; None: one native pool of ``n_slots`` slots. ``pool_bytes``: an
        expert's bytes at each copy precision. ``precision``: how a load's pool is chosen
        with several pools, ``dynamic`` (by the policy's estimate, ``_choose_pool``) or
        ``random`` (with probabilities ``fractions``, one per pool); ``admit``: how much
        sooner than a better pool's worst resident a dynamic miss must be expected, per unit
        of its bytes over the lowest precision's (``_choose_pool``); ``weight_power``: how
        much a miss's router weight counts there (``_choose_pool``); ``upgrades_per_token``:
        most upgrades started per decode step (``_upgrades``).
        ``prefetch_budget``: most prefetch loads in flight; ``prefetch_window``: most pending
        hints (default: the budget). ``allow_oracle``: only the trace simulator may run
        policies that need the future."""
        if scope not in ("global", "layer"):
            raise ValueError(f"scope must be global or layer, got {scope!r}")
        if not allow_oracle:
            _refuse_oracle(policy)
        self.expert_bytes = expert_bytes
        self.n_slots = n_slots  # the arena's slots
        self.capacity = n_slots  # the slots in use (lowered live by set_capacity)
        self.scope = scope
        self.policy_name = policy
        self.prefetch_budget = prefetch_budget
        layers = sorted({layer for layer, _ in expert_bytes})
        if scope == "global":
            self.policies: dict[int | None, EvictionPolicy] = {
                None: make_policy(policy, n_slots, policy_params)}
        else:
            per_layer = n_slots // max(len(layers), 1)
            if per_layer < 1:
                raise ValueError(f"{n_slots} slots cannot give each of {len(layers)} layers one")
            self.policies = {layer: make_policy(policy, per_layer, policy_params)
                             for layer in layers}
        num_experts = max(expert for _, expert in expert_bytes) + 1
        for p in self.policies.values():
            p.configure(layers, num_experts)
        self._layer_aware = needs_core(policy)
        self.slot_of: dict[ExpertKey, int] = {}  # LOADING and RESIDENT experts
        self.loading: dict[ExpertKey, Load] = {}
        self.free_slots = list(range(n_slots - 1, -1, -1))
        self.pins: dict[tuple[Worker, int], list[ExpertKey]] = {}
        # Why a key may not be evicted: one count per pin plus one while it is loading. The
        # policies' victim() is given this dict as the keys to skip.
        self.hold: dict[ExpertKey, int] = {}
        self.prefetched_unused: set[ExpertKey] = set()
        self.prefetch_inflight = 0
        self.prefetch_window = prefetch_budget if prefetch_window is None else prefetch_window
        self.pending_hints: OrderedDict[ExpertKey, None] = OrderedDict()
        # Experts whose last load failed its checksum (a bad block): never prefetched (a hint
        # would cost reads that fail again and evict a good resident); a demand acquire still
        # reads them, and one that succeeds takes the expert off.
        self.bad: set[ExpertKey] = set()
        self.stats = Counter(dict.fromkeys(STATS_KEYS, 0))
        self._init_pools(pools, pool_bytes, precision, fractions, seed, admit, weight_power,
                         upgrades_per_token, scope, policy, policy_params, layers,
                         num_experts, n_slots)

    # --- pins -----------------------------------------------------------------------------

    def _policy(self, key: ExpertKey) -> EvictionPolicy:
        """The policy of a key in the arena (resident or loading)."""
        if self.multi:
            return self.pool_policies[self.pool_index[self.slot_of[key]]]
        return self.policies[None if self.scope == "global" else key[0]]

    def _let_go(self, keys: Iterable[ExpertKey]) -> None:
        hold = self.hold
        for key in keys:
            left = hold[key] - 1
            if left:
                hold[key] = left
            else:
                del hold[key]
                if self.switch_pending and key in self.switch_pending:
                    self._switch(self.switch_pending.pop(key))

    def _unpin(self, worker: Worker, layer: int) -> None:
        keys = self.pins.pop((worker, layer), None)
        if keys:
            self._let_go(keys)

    def release(self, worker: Worker, layers: Iterable[int] | None = None) -> None:
        """Drop the worker's pins of ``layers`` (every layer when None)."""
        if layers is None:
            layers = [layer for (w, layer) in self.pins if w == worker]
        for layer in layers:
            self._unpin(worker, layer)

    def drop_worker(self, worker: Worker) -> int:
        """A worker went away: its pins go, its parked requests are cancelled (never
        answered). Returns how many requests were cancelled."""
        self.release(worker)
        cancelled = 0
        for load in self.loading.values():
            for waiter in load.waiters:
                if waiter.worker == worker and waiter.error is None:
                    waiter.error = AcquireFailed("worker_gone", "the worker went away", [])
                    cancelled += 1
        return cancelled

    def pinned_by(self, worker: Worker) -> dict[int, list[ExpertKey]]:
        return {layer: list(keys) for (w, layer), keys in self.pins.items() if w == worker}

    def pinned_keys(self) -> set[ExpertKey]:
        return {key for keys in self.pins.values() for key in keys}

    # --- room -----------------------------------------------------------------------------

    def _make_room(self, policy: EvictionPolicy, free_slots: list[int] | None = None
                   ) -> int | None:
        """A free slot (of ``free_slots``, the pool's), evicting the policy's victim if
        needed; None if every resident expert of this budget is pinned or loading."""
        if free_slots is None:
            free_slots = self.free_slots
        if free_slots and len(policy) < policy.capacity:
            return free_slots.pop()
        return self._evict(policy)

    def _evict(self, policy: EvictionPolicy) -> int | None:
        """Evict the policy's victim (an unpinned RESIDENT expert) and return its slot; None
        when there is none."""
        victim = policy.victim(self.hold)
        if victim is None:
            return None
        policy.on_evict(victim)
        self.stats["n_evict"] += 1
        if getattr(policy, "fallback", True) is False:  # chosen on a learned estimate
            self.stats["estimates_used"] += 1
        if self.prefetched_unused and victim in self.prefetched_unused:
            self.prefetched_unused.discard(victim)
            self.stats["prefetch_wasted"] += 1
            self.stats["prefetch_wasted_bytes"] += self.expert_bytes[victim]
        return self.slot_of.pop(victim)

    def _new_load(self, key: ExpertKey, slot: int, nbytes: int, prefetch: bool) -> Load:
        return Load(key, slot, nbytes, prefetch)

    def _start_load(self, key: ExpertKey, slot: int, prefetch: bool, pool: int = 0) -> Load:
        load = Load(key, slot, self._load_bytes(key, pool), prefetch)
        self.stats[f"n_load_{self.pool_names[pool]}"] += 1
        self.loading[key] = load
        self.slot_of[key] = slot
        self.hold[key] = self.hold.get(key, 0) + 1
        return load

    # --- requests -------------------------------------------------------------------------

    def acquire(self, worker: Worker, layer: int, experts: list[int],
                release_layers: Iterable[int] = (), tag: Any = None, step: int | None = None,
                weights: Sequence[float] | None = None
                ) -> tuple[list[int], list[Load], Waiter | None]:
        """Plan one request: (slot per expert in request order, loads the caller must start,
        a Waiter when some expert is not resident yet, else None: answer now). ``step``: the
        worker's decode step (``AcquireReq.step``), which tells a layer-aware policy how old
        its estimate is (policies/scored.py). ``weights``: the router's weight of each
        expert (``AcquireReq.weights``), for the choice of a miss's precision; None or
        empty: unknown."""
        pins = self.pins
        for released in release_layers:
            keys = pins.pop((worker, released), None)
            if keys:
                self._let_go(keys)
        keys = pins.pop((worker, layer), None)
        if keys:
            self._let_go(keys)
        slot_of, loading, hold = self.slot_of, self.loading, self.hold
        keys = [(layer, expert) for expert in experts]
        absent = [key for key in keys if key not in slot_of]
        if absent:
            known = self.expert_bytes
            unknown = [key[1] for key in absent if key not in known]
            if unknown:
                raise AcquireFailed("unknown_expert",
                                    f"layer {layer} has no expert(s) {unknown}", unknown)
        policy = self.policies.get(None if self.scope == "global" else layer)
        if policy is None:
            raise AcquireFailed("unknown_layer", f"layer {layer} has no experts", [])
        if step != self._upgrade_step:
            self._upgrade_step, self._upgrades_left = step, self.upgrades_per_token
        if self._layer_aware:
            if self.multi:
                for p in self.pool_policies:
                    p.on_request(layer, experts, step)
            else:
                policy.on_request(layer, experts, step)
        prefetched_unused = self.prefetched_unused
        slots: list[int] = []
        new_loads: list[Load] = []
        pending: list[Load] = []
        pinned: list[ExpertKey] = []
        n_hit = n_miss = n_loading = 0
        # a miss's router weight over the request's mean: its share (1: an even one)
        # (only where it can count: several pools, weighed)
        mean_weight = sum(weights) / len(weights) if weights and self.weight_power and \
            self.multi else 0.0
        try:
            for i, key in enumerate(keys):
                slot = slot_of.get(key)
                if key in pinned:  # a duplicate within this request
                    slots.append(slot)
                    continue
                if slot is None:
                    n_miss += 1
                    share = weights[i] / mean_weight if mean_weight else 1.0
                    target, slot, pool = self._room_for(key, policy, share)
                    if slot is None:
                        raise AcquireFailed(
                            "no_free_slot", f"every one of the {target.capacity} slots of this "
                            f"budget is pinned or loading; raise cache.capacity_experts",
                            [key[1]])
                    # In the policy from now on (loading, so never a victim) so that a
                    # policy's per-miss state is consumed before the next miss.
                    target.on_insert(key)
                    load = Load(key, slot, self._load_bytes(key, pool), False)
                    self.stats[f"n_load_{self.pool_names[pool]}"] += 1
                    loading[key] = load
                    slot_of[key] = slot
                    hold[key] = hold.get(key, 0) + 2  # loading, and pinned below
                    new_loads.append(load)
                    pending.append(load)
                    pinned.append(key)
                    slots.append(slot)
                    continue
                else:
                    (self._policy(key) if self.multi else policy).on_hit(key)  # its pool's
                    load = loading.get(key)
                    if load is None:
                        n_hit += 1
                        if prefetched_unused and key in prefetched_unused:
                            self._prefetch_used(key)
                    else:
                        n_miss += 1
                        n_loading += 1
                        pending.append(load)
                        if load.prefetch and not load.waiters:
                            self._prefetch_used(key)
                hold[key] = hold.get(key, 0) + 1
                pinned.append(key)
                slots.append(slot)
        except AcquireFailed:
            for load in new_loads:
                self._abandon(load)
            new_loads = []
            self._let_go(pinned)
            raise
        finally:
            stats = self.stats
            stats["n_hit"] += n_hit
            if n_miss:
                stats["n_miss"] += n_miss
                stats["n_hit_loading"] += n_loading
                stats["n_load"] += len(new_loads)
        pins[(worker, layer)] = pinned
        if not pending:
            return slots, new_loads, None
        waiter = Waiter(worker, layer, slots, tag, pinned, missing=len(pending))
        for load in pending:
            load.waiters.append(waiter)
        return slots, new_loads, waiter

    def _prefetch_used(self, key: ExpertKey) -> None:
        self.prefetched_unused.discard(key)
        self.stats["prefetch_used"] += 1
        self.stats["prefetch_used_bytes"] += self.expert_bytes[key]

    def _abandon(self, load: Load) -> None:
        """Undo a load that was planned but never started."""
        del self.loading[load.key]
        self._policy(load.key).on_evict(load.key)
        del self.slot_of[load.key]
        self._let_go((load.key,))
        self._free_list(load.slot).append(load.slot)

    def hint(self, layer: int, experts: Iterable[int]) -> None:
        """Experts a worker or predictor expects next (a PrefetchHint). They wait in the
        pending queue, newest last and at most ``prefetch_window`` of them (the oldest go),
        until ``issue_prefetches`` finds free queue depth and budget for them."""
        pending = self.pending_hints
        for expert in experts:
            key = (layer, expert)
            if key in self.bad:
                self.stats["prefetch_bad_skipped"] += 1
            elif key in self.expert_bytes and key not in self.slot_of:
                pending.pop(key, None)
                pending[key] = None
        while len(pending) > self.prefetch_window:
            pending.popitem(last=False)
            self.stats["prefetch_dropped"] += 1

    def look_ahead_ready(self) -> bool:
        """Whether the learned look-ahead prefetch can run: a prefetch budget, global scope,
        a policy with a usable estimate (FlashMoE not in its LRU fallback) and a full cache
        (while it fills, the look-ahead has no victim to weigh a load against)."""
        policy = self.policies.get(None)
        return bool(self.prefetch_budget) and self.scope == "global" \
            and hasattr(policy, "can_look_ahead") and policy.can_look_ahead()

    def inline_may_hint(self, learned: int, with_learned: bool) -> bool:
        """Whether the inline next-layer prefetcher hints after a request: always with
        ``with_learned`` (``prefetch.inline_with_learned``) or no look-ahead (``learned``, its
        count, 0), else only while the look-ahead cannot run (``look_ahead_ready``)."""
        return with_learned or not learned or not self.look_ahead_ready()

    def learned_hints(self, count: int, margin: float = 0.0, ratio: float = 1.0,
                      skip: int = 0) -> int:
        """FlashMoE's look-ahead prefetch: while no demand load is in flight (the disk would
        idle), hint up to ``count`` experts the policy's estimate wants sooner than the
        residents they would evict (``FlashMoEPolicy.wanted``: ``margin`` tokens sooner, at
        most 1/``ratio`` of the victim's expected next use, not in the next ``skip``
        layers). Nothing without a prefetch budget, while hints are pending, or in layer
        scope (a layer's own policy sees only its layer's requests, not where the token is
        now). Returns the number hinted."""
        if count <= 0 or self.pending_hints or len(self.loading) > self.prefetch_inflight \
                or not self.look_ahead_ready():
            return 0
        hinted = 0
        for layer, expert in self.policies[None].wanted(count, margin, ratio, skip):
            self.hint(layer, [expert])
            hinted += 1
        self.stats["prefetch_learned"] += hinted
        return hinted

    def issue_prefetches(self, max_loads: int) -> list[Load]:
        """Start loads for pending hints, oldest first: at most ``max_loads`` (the free IO
        queue depth, in experts) and within the prefetch budget (loads in flight). A hint
        whose expert became resident or loading meanwhile is dropped; a prefetch never fails:
        it stops where no victim can be found. With no hint pending, dynamic precision's
        upgrades (``_upgrades``) take the room."""
        room = min(max_loads, self.prefetch_budget - self.prefetch_inflight)
        loads: list[Load] = []
        pending = self.pending_hints
        if not pending:
            return self._upgrades(room)
        while room > 0 and pending:
            key = next(iter(pending))
            if key in self.slot_of:
                del pending[key]
                continue
            policy, slot, pool = self._room_for(
                key, None if self.multi else self.policies[None if self.scope == "global"
                                                           else key[0]])
            if slot is None:
                break
            del pending[key]
            policy.on_prefetch(key)
            load = self._start_load(key, slot, prefetch=True, pool=pool)
            self.stats["n_load"] += 1
            self.prefetch_inflight += 1
            self.stats["prefetch_issued"] += 1
            self.stats["prefetch_bytes"] += load.nbytes
            loads.append(load)
            room -= 1
        return loads

    def finish_load(self, key: ExpertKey, ok: bool, code: str = "io_error",
                    message: str = "") -> list[Waiter]:
        """A load ended (read and verified, or failed). Returns the waiters it completed
        (``missing == 0``, ``error is None``: answer with their slots) or failed (``error``
        set: answer with it; their layer's pins are already dropped). Cancelled waiters are
        not returned."""
        if key in self.upgrading:  # (a key upgrading is resident: never loading too)
            self._finish_upgrade(key, ok)
            return []
        load = self.loading.pop(key)
        hold = self.hold
        left = hold[key] - 1
        if left:
            hold[key] = left
        else:
            del hold[key]
        if load.prefetch:
            self.prefetch_inflight -= 1
        done: list[Waiter] = []
        if ok:
            self.bad.discard(key)
            self.stats["n_byte_loaded"] += load.nbytes
            if load.prefetch and not load.waiters:
                self.prefetched_unused.add(key)
            for waiter in load.waiters:
                if waiter.error is None:
                    waiter.missing -= 1
                    if waiter.missing == 0:
                        done.append(waiter)
            return done
        self.stats["n_load_failed"] += 1
        if code == "checksum":
            self.bad.add(key)
        if load.prefetch:
            self.stats["prefetch_failed"] += 1
        self._policy(key).on_evict(key)
        del self.slot_of[key]
        self._free_list(load.slot).append(load.slot)
        for waiter in load.waiters:
            if waiter.error is None:
                waiter.error = AcquireFailed(code, message or f"loading layer {key[0]} expert "
                                             f"{key[1]} failed", [key[1]])
                if self.pins.get((waiter.worker, waiter.layer)) is waiter.pins:
                    self._unpin(waiter.worker, waiter.layer)
                done.append(waiter)
        return done

    def fail_all_loads(self, code: str, message: str) -> list[Waiter]:
        """Fail every load in flight (the IO engine died): the waiters to answer."""
        done = []
        for key in list(self.loading):
            done += self.finish_load(key, ok=False, code=code, message=message)
        for key in list(self.upgrading):
            self._finish_upgrade(key, False)
        return done

    # --- estimates ----------------------------------------------------------------------------

    def set_estimate(self, S, layers: list[int] | None = None, step: int | None = None
                     ) -> bool:
        """Hand a predictor's estimate (or None: none usable) to a policy that takes one;
        False when the policy does not. ``step``: the decode step the estimate is for, in the
        numbering of ``acquire``'s steps (None: not known)."""
        taken = False
        for policy in (self.pool_policies if self.multi else self.policies.values()):
            if getattr(policy, "accepts_estimates", False):
                policy.set_estimate(S, layers, step)
                taken = True
        return taken

    def set_policy(self, policy: str, policy_params: Mapping | None = None) -> None:
        """Switch the eviction policy while running: the new policy (or one per layer) starts
        with every expert now in the arena (resident or loading) as just inserted; pins,
        loads and slots are untouched. Raises PolicyError (unknown name, bad parameters, an
        oracle) and changes nothing then."""
        _refuse_oracle(policy)
        self._refuse_multi("cache.policy")
        layers = sorted({layer for layer, _ in self.expert_bytes})
        num_experts = max(expert for _, expert in self.expert_bytes) + 1
        if self.scope == "global":
            policies = {None: make_policy(policy, self.capacity, policy_params)}
        else:
            per_layer = self.capacity // max(len(layers), 1)
            policies = {layer: make_policy(policy, per_layer, policy_params)
                        for layer in layers}
        for p in policies.values():
            p.configure(layers, num_experts)
        for key in self.slot_of:
            policies[None if self.scope == "global" else key[0]].on_insert(key)
        self.policies, self.policy_name = policies, policy
        self._layer_aware = needs_core(policy)

    def check_policy(self, policy: str, policy_params: Mapping | None = None) -> None:
        """Raise PolicyError where ``set_policy`` would; change nothing."""
        _refuse_oracle(policy)
        make_policy(policy, self.capacity, policy_params)

    def set_capacity(self, capacity: int, check: bool = False) -> None:
        """Use ``capacity`` of the arena's slots from now on (global scope): going down evicts
        the policy's victims until the experts in the arena fit, and is refused (PolicyError,
        nothing changed) below what pins and loads hold; going up is bounded by the arena.
        The policy restarts with the experts in the arena, with its parameters kept."""
        if self.scope != "global":
            raise PolicyError("layer scope: each layer's budget is set at start; restart to "
                              "change cache.capacity_experts")
        self._refuse_multi("cache.capacity_experts")
        if not 1 <= capacity <= self.n_slots:
            raise PolicyError(f"cache.capacity_experts = {capacity}: the arena has "
                              f"{self.n_slots} slots (sized at start; restart to grow it)")
        held = sum(1 for key in self.slot_of if self.hold.get(key))
        if capacity < held:
            raise PolicyError(f"cache.capacity_experts = {capacity}: pins and loads hold {held} "
                              f"experts now; the capacity can go down to {held}")
        if check:
            return
        policy = self.policies[None]
        while len(self.slot_of) > capacity:
            self.free_slots.append(self._evict(policy))
        params = dataclasses.asdict(policy.params)
        self.capacity = capacity
        self.set_policy(self.policy_name, params)

    # --- gauges ---------------------------------------------------------------------------

    def policy_params_json(self) -> str:
        """The policy's effective parameters (defaults filled in), as JSON."""
        params = next(iter(self.policies.values())).params
        return json.dumps(dataclasses.asdict(params), sort_keys=True)

    def resident(self) -> int:
        return len(self.slot_of) - len(self.loading)

    def gauges(self) -> dict[str, int]:
        return {"resident": self.resident(), "loading": len(self.loading),
                "pinned": len(self.pinned_keys()), "prefetch_inflight": self.prefetch_inflight,
                "prefetch_pending": len(self.pending_hints), "n_slots": self.n_slots,
                "capacity": self.capacity}
