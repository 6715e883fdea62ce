"""Live changes to a running cache manager (``TuneReq`` on its control socket, on the control
thread under the service's lock): the policy and its parameters (e.g. the FlashMoE policy's
hybrid share), the capacity within the arena, the prefetch window, and the inline next-layer
prefetcher (on or off, its threshold), which ``Tuning`` owns. ``predictor.max_age_ms`` and the
look-ahead prefetch's settings are read from the config at each use: taken as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from common.config import FlashMoEConfig

from .core import CacheManagerCore
from .policies import POLICIES, PolicyError, needs_future
from .prefetcher import NextLayerPrefetcher, PrefetcherParams

# Live fields read from the config where they are used: nothing to do but take them.
READ_AT_USE = ("predictor.max_age_ms", "prefetch.learned", "prefetch.learned_margin",
               "prefetch.learned_ratio", "prefetch.learned_skip", "prefetch.inline_with_learned")


def live_policies() -> list[str]:
    """The policies a running cache manager can take (not those that need the future)."""
    return sorted(name for name in POLICIES if not needs_future(name))


class Tuning:
    def __init__(self, config: FlashMoEConfig, core: CacheManagerCore, layers: int,
                 experts: int, top_k: int) -> None:
        self.config, self.core = config, core
        self.shape = (layers, experts, top_k)
        self.prefetcher = self.make_prefetcher(config.prefetch.inline
                                               and bool(config.prefetch.budget))

    def make_prefetcher(self, on: bool) -> NextLayerPrefetcher | None:
        threshold = self.config.prefetch.threshold
        return NextLayerPrefetcher(*self.shape, PrefetcherParams(threshold=threshold)) \
            if on else None

    def tune(self, changes: dict[str, Any], check: bool) -> tuple[list[str], dict[str, str]]:
        """The keys taken (applied unless ``check``) and {key: why} for those refused."""
        applied, refused = [], {}
        core = self.core
        for key, value in changes.items():
            if key == "cache.policy":
                if needs_future(value):
                    refused[key] = f"{value} needs the future (simulator only)"
                    continue
                if not check:
                    try:
                        params = changes.get("cache.policy_params",
                                             self.config.cache.policy_params
                                             if value == core.policy_name else None)
                        core.set_policy(value, params)
                    except PolicyError as exc:
                        refused[key] = str(exc)
                        continue
            elif key == "cache.policy_params":
                name = changes.get("cache.policy", core.policy_name)
                try:
                    core.check_policy(name, value)
                    if not check:
                        core.set_policy(name, value)
                except PolicyError as exc:
                    refused[key] = str(exc)
                    continue
            elif key == "cache.capacity_experts":
                try:
                    core.set_capacity(value, check=check)
                except PolicyError as exc:
                    refused[key] = str(exc)
                    continue
            elif key == "prefetch.window":
                if not check:
                    core.prefetch_window = min(value, core.prefetch_budget)
            elif key == "prefetch.threshold":
                if not check and self.prefetcher is not None:
                    self.prefetcher.params = dataclasses.replace(self.prefetcher.params,
                                                                 threshold=value)
            elif key == "prefetch.inline":
                if value and not self.config.prefetch.budget:
                    refused[key] = "prefetch.budget is 0: no prefetch can run"
                    continue
                if not check:
                    self.prefetcher = self.make_prefetcher(value)
            elif key not in READ_AT_USE:
                continue
            applied.append(key)
        return applied, refused
