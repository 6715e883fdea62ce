"""The cache manager core's pools of precisions (``cache.precision``; docs/architecture.md,
"Expert precision"): which pool a load goes to, and the upgrades of dynamic precision.

One pool (native, or a copy's) is the plain cache. Several (native, int8, int4) each keep a
policy of their own over the one key space, with one bookkeeping (the core's ``slot_of``,
pins and loads): ``dynamic`` chooses a load's pool by the learned estimate
(``_choose_pool``) and upgrades resident experts while the disk would idle
(``_upgrades``); ``random`` draws it (the ablation).
"""

from __future__ import annotations

import random

import numpy as np

from .policies import EvictionPolicy, PolicyError, make_policy

ExpertKey = tuple[int, int]  # (layer, expert)


class PrecisionPools:
    """Mixed into ``CacheManagerCore``: its pools, their choice and the upgrades."""

    def _init_pools(self, pools, pool_bytes, precision, fractions, seed, admit, weight_power,
                    upgrades_per_token, scope, policy, policy_params, layers, num_experts,
                    n_slots) -> None:
        # --- pools of precisions: several (dynamic, random) or one of a copy (int8, int4) ---
        pools = pools or [("native", list(range(n_slots)))]
        self.pool_names = [name for name, _ in pools]
        self.multi = len(pools) > 1
        self.precision = precision if self.multi else pools[0][0]
        self.pool_bytes = dict(pool_bytes or {})  # (native: the core's expert_bytes)
        if self.multi:
            if scope != "global":
                raise ValueError("a cache of several precisions keeps one global policy per "
                                 "precision; cache.scope must be global")
            if precision not in ("dynamic", "random"):
                raise ValueError(f"several pools need precision dynamic or random, not "
                                 f"{precision!r}")
            if precision == "dynamic" and not hasattr(self.policies[None], "scores"):
                raise PolicyError(f"cache.precision = dynamic chooses by the learned estimate: "
                                  f"it needs cache.policy = flashmoe, not {policy!r} (random "
                                  f"or a uniform precision work with any policy)")
            self.pool_policies = [make_policy(policy, len(slots), policy_params)
                                  for _, slots in pools]
            for p in self.pool_policies:
                p.configure(layers, num_experts)
            self.policies = {None: self.pool_policies[-1]}  # the look-ahead weighs int4's
            self.pool_free = [list(reversed(slots)) for _, slots in pools]
            self.free_slots = []
            self.pool_index = {slot: i for i, (_, slots) in enumerate(pools) for slot in slots}
            weights = list(fractions or [1.0] * len(pools))
            if len(weights) != len(pools) or min(weights) < 0 or sum(weights) <= 0:
                raise ValueError(f"precision fractions {weights}: one non-negative value per "
                                 f"precision ({', '.join(self.pool_names)}), not all 0")
            self.fractions = [w / sum(weights) for w in weights]
            low = self._load_bytes((layers[0], 0), len(pools) - 1) or 1
            # a pool's bytes over the lowest's, raised to ``admit``: the factor by which a miss
            # must be expected sooner than the pool's worst resident to be loaded there
            self.admit_factor = [(self._load_bytes((layers[0], 0), i) / low) ** admit
                                 for i in range(len(pools))]
            self._rng = random.Random(seed)
        else:
            self.free_slots = list(reversed(pools[0][1]))
        for name in self.pool_names:
            self.stats[f"n_load_{name}"] = 0
        # dynamic: upgrades of resident experts to a better precision (``_upgrades``)
        self.upgrading: dict[ExpertKey, object] = {}
        self.switch_pending: dict[ExpertKey, object] = {}  # read, waiting for the pins to go
        self.upgrades_per_token = upgrades_per_token
        self.weight_power = weight_power  # (``_choose_pool``)
        self._upgrade_step: int | None = None  # the step whose upgrades are counted
        self._upgrades_left = upgrades_per_token
        if self.multi:
            self.stats.update(upgrades_issued=0, upgrades_done=0, upgrades_failed=0)

    def _free_list(self, slot: int) -> list[int]:
        return self.pool_free[self.pool_index[slot]] if self.multi else self.free_slots

    def precision_of(self, slot: int) -> str:
        return self.pool_names[self.pool_index[slot]] if self.multi else self.pool_names[0]

    def _load_bytes(self, key: ExpertKey, pool: int) -> int:
        name = self.pool_names[pool]
        return self.expert_bytes[key] if name == "native" else self.pool_bytes[name]

    def _choose_pool(self, key: ExpertKey, share: float = 1.0) -> int:
        """The pool a load of ``key`` goes to. ``random``: drawn with ``fractions``.
        ``dynamic``: the best precision whose pool has room, or whose worst resident (the
        largest eviction score, i.e. latest expected next use) is expected later than this
        key's next use after the present one times ``admit_factor`` (a native load reads
        ~3.5x an int4 one's bytes: it must be worth it) over ``share`` (the expert's router
        weight over the request's mean: 1 for an even share) to ``weight_power`` (its error
        counts in proportion to its weight, now and, as weights recur, later); the lowest
        precision when none is (or while the policy has no estimate)."""
        if self.precision == "random":
            return self._rng.choices(range(len(self.pool_names)), weights=self.fractions)[0]
        last = len(self.pool_names) - 1
        top = self.pool_policies[0]
        if getattr(top, "fallback", True):
            return last
        i = top._index(key)
        score = top._d[top.layer][i] + top.S[2][i]
        if self.weight_power and share != 1.0:
            score /= max(share, 1e-3) ** self.weight_power
        for pool in range(last):
            policy, free = self.pool_policies[pool], self.pool_free[pool]
            if free and len(policy) < policy.capacity:
                return pool
            worst = self._worst_score(policy)
            if worst is not None and score * self.admit_factor[pool] < worst:
                return pool
        return last

    def _worst_score(self, policy) -> float | None:
        """The largest eviction score among a pool's residents that may be evicted."""
        idx = policy._candidates()
        if self.hold:
            E = policy.num_experts
            held = np.fromiter((layer * E + expert for layer, expert in self.hold), np.int64)
            idx = idx[~np.isin(idx, held)]
        if not len(idx):
            return None
        return float(policy.scores()[idx].max())

    def _room_for(self, key: ExpertKey, policy: EvictionPolicy | None, share: float = 1.0
                  ) -> tuple[EvictionPolicy, int | None, int]:
        """(the policy, a slot or None, the pool) of a new load of ``key``: with several
        pools, the chosen pool's (``_choose_pool``, ``share`` its router weight over the
        request's mean); else ``policy``'s, the key's own."""
        pool = 0
        if self.multi:
            pool = self._choose_pool(key, share)
            policy = self.pool_policies[pool]
        policy.on_miss(key)
        return policy, self._make_room(policy, self.pool_free[pool] if self.multi else None), \
            pool

    # --- upgrades (dynamic precision) ---------------------------------------------------------

    def may_upgrade(self) -> bool:
        """Whether ``issue_prefetches`` may start upgrades now: dynamic precision, a usable
        estimate, and no demand read in flight (the disk would idle)."""
        return self.multi and self.precision == "dynamic" and self._upgrades_left > 0 \
            and not getattr(self.pool_policies[0], "fallback", True) \
            and len(self.loading) + len(self.upgrading) <= self.prefetch_inflight

    def _upgrades(self, room: int) -> list:
        """Up to ``room`` reads of resident experts at a better precision: those expected
        soonest among the unpinned residents of the lower pools, each into the best pool
        that has room or whose worst resident is expected later (that one is evicted). The
        expert stays served from its old slot until the read is in and its pins are gone
        (``_switch``)."""
        room = min(room, self._upgrades_left)
        if room <= 0 or not self.may_upgrade():
            return []
        top = self.pool_policies[0]
        E = top.num_experts
        scores = top.scores()
        lower = np.zeros(len(scores), dtype=bool)
        for policy in self.pool_policies[1:]:
            lower |= policy.resident
        busy = [layer * E + expert for layer, expert in
                (*self.hold, *self.upgrading, *self.switch_pending)]
        lower[busy] = False
        candidates = np.flatnonzero(lower)
        if not len(candidates):
            return []
        order = candidates[np.argsort(scores[candidates], kind="stable")[:room]]
        loads: list = []
        worst = [None] * len(self.pool_names)
        for i in order.tolist():
            key = (i // E, i % E)
            here = self.pool_index[self.slot_of[key]]
            for pool in range(here):
                policy, free = self.pool_policies[pool], self.pool_free[pool]
                if not (free and len(policy) < policy.capacity):
                    if worst[pool] is None:
                        worst[pool] = self._worst_score(policy)
                    if worst[pool] is None or \
                            scores[i] * self.admit_factor[pool] >= worst[pool]:
                        continue
                slot = self._make_room(policy, free)
                if slot is None:
                    continue
                worst[pool] = None  # its residents changed
                load = self._new_load(key, slot, self._load_bytes(key, pool), True)
                load.upgrade = True
                self.upgrading[key] = load
                self.hold[key] = self.hold.get(key, 0) + 1  # never evicted meanwhile
                self.prefetch_inflight += 1
                self.stats["n_load"] += 1
                self.stats[f"n_load_{self.pool_names[pool]}"] += 1
                self.stats["upgrades_issued"] += 1
                self._upgrades_left -= 1
                loads.append(load)
                break
        return loads

    def _finish_upgrade(self, key: ExpertKey, ok: bool) -> None:
        load = self.upgrading.pop(key)
        self.prefetch_inflight -= 1
        if not ok:
            self.stats["upgrades_failed"] += 1
            self._free_list(load.slot).append(load.slot)
            self._let_go((key,))
            return
        self.stats["n_byte_loaded"] += load.nbytes
        self.switch_pending[key] = load
        self._let_go((key,))  # switches now unless a worker holds it (then at its release)

    def _switch(self, load) -> None:
        """An upgrade's read is in and nobody holds the expert: serve it from the new slot."""
        key = load.key
        old = self.slot_of[key]
        self.pool_policies[self.pool_index[old]].on_evict(key)
        self._free_list(old).append(old)
        self.slot_of[key] = load.slot
        self.pool_policies[self.pool_index[load.slot]].on_prefetch(key)
        self.stats["upgrades_done"] += 1

    def _refuse_multi(self, setting: str) -> None:
        if self.multi:
            raise PolicyError(f"{setting}: a cache of several precisions (cache.precision = "
                              f"{self.precision}) is laid out at start; restart to change it")
