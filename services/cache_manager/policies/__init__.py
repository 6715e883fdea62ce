"""The policy registry: one dict from name to class, one factory."""

from __future__ import annotations

from typing import Any, Mapping

from .arc import ARCPolicy
from .base import EvictionPolicy, PolicyError, build_params
from .belady import BeladyPolicy
from .car import CARPolicy
from .fifo import FIFOPolicy
from .flashmoe import FlashMoEPolicy
from .lfu import LFUPolicy
from .lirs import LIRSPolicy
from .leaststale import LeastStalePolicy
from .lru import LRUPolicy
from .nextuse import NextUsePolicy
from .s3fifo import S3FIFOPolicy
from .sieve import SIEVEPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, LFUPolicy, FIFOPolicy, ARCPolicy, LIRSPolicy, CARPolicy,
                              S3FIFOPolicy, SIEVEPolicy, BeladyPolicy, LeastStalePolicy,
                              NextUsePolicy, FlashMoEPolicy)
}


def make_policy(name: str, capacity: int, params: Mapping[str, Any] | None = None) -> EvictionPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; registered: {', '.join(sorted(POLICIES))}") from None
    return cls(capacity, build_params(cls, params))


def needs_future(name: str) -> bool:
    """True for oracle policies (Belady) that only the trace simulator can drive."""
    return bool(getattr(POLICIES.get(name), "needs_future", False))


def needs_core(name: str) -> bool:
    """True for policies that follow the layer order through the cache manager's core, which
    the plain per-request replay cannot drive."""
    return bool(getattr(POLICIES.get(name), "needs_core", False))


__all__ = ["POLICIES", "EvictionPolicy", "PolicyError", "make_policy", "needs_core",
           "needs_future"]
