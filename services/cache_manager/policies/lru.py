"""LRU: evict the least recently used resident key.

    on hit / insert: move key to the MRU end
    victim: the first unpinned key from the LRU end
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Container

from .base import NOTHING_PINNED, EvictionPolicy, Key, PolicyError


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int, params=None) -> None:
        super().__init__(capacity, params)
        self._order: OrderedDict[Key, None] = OrderedDict()  # LRU first

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def on_hit(self, key: Key) -> None:
        self._order.move_to_end(key)

    def on_insert(self, key: Key) -> None:
        self._order[key] = None

    def victim(self, pinned: Container[Key] = NOTHING_PINNED) -> Key | None:
        return next((key for key in self._order if key not in pinned), None)

    def on_evict(self, key: Key) -> None:
        del self._order[key]

    def request(self, key: Key, pinned: Container[Key] = NOTHING_PINNED) -> bool:
        order = self._order
        if key in order:
            order.move_to_end(key)
            return True
        if len(order) >= self.capacity:
            if pinned:
                victim = self.victim(pinned)
                if victim is None:
                    raise PolicyError(f"{self.name}: every resident key is pinned")
                del order[victim]
            else:
                order.popitem(last=False)
        order[key] = None
        return False
