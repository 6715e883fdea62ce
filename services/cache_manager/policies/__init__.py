"""The policy registry: one dict from name to class, one factory."""

from __future__ import annotations

from typing import Any, Mapping

from .base import EvictionPolicy, PolicyError, build_params
from .lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy,)
}


def make_policy(name: str, capacity: int, params: Mapping[str, Any] | None = None) -> EvictionPolicy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; registered: {', '.join(sorted(POLICIES))}") from None
    return cls(capacity, build_params(cls, params))


__all__ = ["POLICIES", "EvictionPolicy", "PolicyError", "make_policy"]
