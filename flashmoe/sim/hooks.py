"""What the replay and the learning path share: the hooks a replay calls beside the cache
manager's core, and the worker identity the simulated requests carry."""

from __future__ import annotations

from services.cache_manager.core import CacheManagerCore

SIM_WORKER = b"simulated-worker"


class ReplayHooks:
    """What runs beside the cache manager's core in a replay (the learning path, the inline
    prefetcher): called on the virtual clock, in stream order. The default does nothing."""

    def start(self, core: CacheManagerCore) -> None:
        """A cache lifetime begins (once in the global scope, per sequence in the layer one)."""

    def before_request(self, core: CacheManagerCore, now_ms: float, token: int,
                       layer: int) -> None:
        """Before each acquire: e.g. deliver the newest prediction on its cadence."""

    def after_request(self, core: CacheManagerCore, now_ms: float, token: int, layer: int,
                      experts: list[int]) -> None:
        """After each acquire was answered: e.g. hint the next layers' experts."""

    def after_token(self, token: int, now_ms: float) -> None:
        """A token's last layer ran: its access event goes down the learning path."""
