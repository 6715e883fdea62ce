"""The eviction-policy interface shared by the live cache manager and the trace simulator.

A policy only keeps order: it is told about hits, misses, insertions and evictions, and asked
to *choose* a victim; the cache that owns it decides when to evict and carries it out (deciding
is separate from acting, as in libCacheSim). Keys are hashable (``(layer, expert)`` tuples in
the cache manager, ints in the simulator). Pinned keys are never chosen.

The protocol of one request for key x, which ``request`` implements and the live cache manager
follows step by step:

    if x in policy:  policy.on_hit(x)                      -> hit
    else:            policy.on_miss(x)                     (ghost bookkeeping, adaptation)
                     while len(policy) >= capacity:
                         v = policy.victim(pinned); policy.on_evict(v)
                     policy.on_insert(x)                   -> miss
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Container, Hashable, Mapping

Key = Hashable
NOTHING_PINNED: frozenset = frozenset()


class PolicyError(ValueError):
    """Unknown policy, unknown or out-of-range parameter."""


@dataclasses.dataclass(frozen=True)
class NoParams:
    """A policy without tunable parameters."""


class EvictionPolicy(ABC):
    name: ClassVar[str]
    Params: ClassVar[type] = NoParams
    needs_core: ClassVar[bool] = False  # follows the layer order (on_request, configure)

    def __init__(self, capacity: int, params: Any = None) -> None:
        if capacity < 1:
            raise PolicyError(f"{self.name}: capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.params = params if params is not None else self.Params()

    def configure(self, layers: list[int], num_experts: int) -> None:
        """The key space, (layer, expert) pairs; the cache manager's core tells every policy."""

    def on_request(self, layer: int, experts: list[int] = (), step: int | None = None) -> None:
        """A request for ``experts`` of ``layer`` begins (the core calls it for ``needs_core``
        policies, before the request's keys); ``step``: the worker's decode step it belongs
        to, when the worker says (``AcquireReq.step``)."""

    @abstractmethod
    def __contains__(self, key: Key) -> bool:
        """Is the key resident (as far as this policy knows)?"""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    @abstractmethod
    def on_hit(self, key: Key) -> None:
        """A resident key was requested."""

    def on_miss(self, key: Key) -> None:
        """A non-resident key was requested; called before room is made for it."""

    @abstractmethod
    def on_insert(self, key: Key) -> None:
        """A missed key became resident (the cache made room first)."""

    def on_prefetch(self, key: Key) -> None:
        """A key loaded ahead of any request (a prefetch) became resident; by default the same
        as a missed key's insertion."""
        self.on_insert(key)

    @abstractmethod
    def victim(self, pinned: Container[Key] = NOTHING_PINNED) -> Key | None:
        """The resident key to evict next, never a pinned one; None if every key is pinned."""

    @abstractmethod
    def on_evict(self, key: Key) -> None:
        """The cache removed ``key`` (normally the chosen victim)."""

    def request(self, key: Key, pinned: Container[Key] = NOTHING_PINNED) -> bool:
        """One whole request (the protocol above); True on a hit. Policies may override it
        with a fused fast path that must give the same decisions (tests check that)."""
        if key in self:
            self.on_hit(key)
            return True
        self.on_miss(key)
        while len(self) >= self.capacity:
            victim = self.victim(pinned)
            if victim is None:
                raise PolicyError(f"{self.name}: every resident key is pinned")
            self.on_evict(victim)
        self.on_insert(key)
        return False


def build_params(policy_cls: type[EvictionPolicy], values: Mapping[str, Any] | None) -> Any:
    """Typed parameters of a policy from a plain mapping; an unknown key is an error."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(policy_cls.Params)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        allowed = ", ".join(fields) or "none"
        raise PolicyError(f"{policy_cls.name}: unknown parameter(s) {', '.join(unknown)} "
                          f"(allowed: {allowed})")
    try:
        params = policy_cls.Params(**{k: type(fields[k].default)(v) for k, v in values.items()})
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"{policy_cls.name}: bad parameter value: {exc}") from None
    check = getattr(params, "check", None)
    if check is not None:
        check()
    return params
