"""The cache manager's decision core: residency, slots, pins and the eviction policy.

Pure bookkeeping, no sockets and no IO, usable in-process. ``acquire`` answers which slot each
requested expert is (or will be) in and which loads must happen first; the process shell runs
those loads through the IO engine and reports each one back with ``finish_load``.

Pins: every expert a worker acquired stays pinned until that worker's next request (or its
``release``); a pinned expert is never chosen as a victim.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .policies import EvictionPolicy, PolicyError, make_policy, needs_future

ExpertKey = tuple[int, int]  # (layer, expert)


class AcquireFailed(Exception):
    def __init__(self, code: str, message: str, experts: list[int]) -> None:
        super().__init__(message)
        self.code, self.experts = code, experts


@dataclass
class AcquirePlan:
    slots: list[int]  # slot per requested expert, request order
    loads: list[tuple[ExpertKey, int]] = field(default_factory=list)  # (key, slot) to read


class CacheManagerCore:
    def __init__(self, known: set[ExpertKey], n_slots: int, policy: str = "lru",
                 policy_params: dict | None = None, scope: str = "global") -> None:
        if scope not in ("global", "layer"):
            raise ValueError(f"scope must be global or layer, got {scope!r}")
        if needs_future(policy):
            raise PolicyError(f"policy {policy!r} needs future knowledge; only the trace "
                              f"simulator (`flashmoe bench`) can run it")
        self.known = known
        self.n_slots = n_slots
        self.scope = scope
        layers = sorted({layer for layer, _ in known})
        if scope == "global":
            self._policies = {None: make_policy(policy, n_slots, policy_params)}
        else:
            per_layer = n_slots // max(len(layers), 1)
            if per_layer < 1:
                raise ValueError(f"{n_slots} slots cannot give each of {len(layers)} layers one")
            self._policies = {layer: make_policy(policy, per_layer, policy_params)
                              for layer in layers}
        self.policy_name = policy
        self.slot_of: dict[ExpertKey, int] = {}
        self.free_slots = list(range(n_slots - 1, -1, -1))
        self.pins: dict[bytes, list[ExpertKey]] = {}
        self.pin_count: Counter[ExpertKey] = Counter()
        self.stats = Counter(n_hit=0, n_miss=0, n_evict=0, n_load_failed=0)

    def _policy(self, key: ExpertKey) -> EvictionPolicy:
        return self._policies[None if self.scope == "global" else key[0]]

    def release(self, worker: bytes) -> None:
        for key in self.pins.pop(worker, ()):
            self.pin_count[key] -= 1
            if not self.pin_count[key]:
                del self.pin_count[key]

    def _pin(self, worker: bytes, key: ExpertKey) -> None:
        self.pins.setdefault(worker, []).append(key)
        self.pin_count[key] += 1

    def _make_room(self, key: ExpertKey) -> int:
        policy = self._policy(key)
        if self.free_slots and len(policy) < policy.capacity:
            return self.free_slots.pop()
        victim = policy.victim(self.pin_count)
        if victim is None:
            raise AcquireFailed("no_free_slot",
                                f"every one of the {policy.capacity} slots of this budget is "
                                f"pinned or loading; raise cache.capacity_experts", [key[1]])
        policy.on_evict(victim)
        self.stats["n_evict"] += 1
        return self.slot_of.pop(victim)

    def acquire(self, worker: bytes, layer: int, experts: list[int]) -> AcquirePlan:
        """Plan an acquire; the worker's previous pins are dropped first."""
        self.release(worker)
        unknown = [e for e in experts if (layer, e) not in self.known]
        if unknown:
            raise AcquireFailed("unknown_expert", f"layer {layer} has no expert(s) {unknown}",
                                unknown)
        plan = AcquirePlan(slots=[])
        planned: dict[ExpertKey, int] = {}
        try:
            for expert in experts:
                key = (layer, expert)
                if key in planned:
                    plan.slots.append(planned[key])
                    continue
                slot = self.slot_of.get(key)
                if slot is not None:
                    self.stats["n_hit"] += 1
                    self._policy(key).on_hit(key)
                else:
                    self.stats["n_miss"] += 1
                    policy = self._policy(key)
                    policy.on_miss(key)
                    slot = self._make_room(key)
                    # In the policy from now on (pinned, so never a victim) so that a policy's
                    # per-miss state is consumed before the next miss of this request.
                    policy.on_insert(key)
                    plan.loads.append((key, slot))
                self._pin(worker, key)
                planned[key] = slot
                plan.slots.append(slot)
        except AcquireFailed:
            for key, slot in plan.loads:
                self._policy(key).on_evict(key)
                self.free_slots.append(slot)
            self.release(worker)
            raise
        return plan

    def finish_load(self, key: ExpertKey, slot: int, ok: bool) -> None:
        """A planned load ended; on success the expert becomes resident in ``slot``."""
        if ok:
            self.slot_of[key] = slot
        else:
            self.stats["n_load_failed"] += 1
            self._policy(key).on_evict(key)
            self.free_slots.append(slot)

    def resident(self) -> int:
        return len(self.slot_of)
