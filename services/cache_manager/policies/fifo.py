"""FIFO: evict the resident key that was inserted first; hits change nothing.

    on insert: append key at the tail
    victim: the first unpinned key from the head
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Container

from .base import NOTHING_PINNED, EvictionPolicy, Key, PolicyError


class FIFOPolicy(EvictionPolicy):
    name = "fifo"

    def __init__(self, capacity: int, params=None) -> None:
        super().__init__(capacity, params)
        self._queue: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def __contains__(self, key: Key) -> bool:
        return key in self._queue

    def __len__(self) -> int:
        return len(self._queue)

    def on_hit(self, key: Key) -> None:
        pass

    def on_insert(self, key: Key) -> None:
        self._queue[key] = None

    def victim(self, pinned: Container[Key] = NOTHING_PINNED) -> Key | None:
        return next((key for key in self._queue if key not in pinned), None)

    def on_evict(self, key: Key) -> None:
        del self._queue[key]

    def request(self, key: Key, pinned: Container[Key] = NOTHING_PINNED) -> bool:
        queue = self._queue
        if key in queue:
            return True
        if len(queue) >= self.capacity:
            if pinned:
                victim = self.victim(pinned)
                if victim is None:
                    raise PolicyError(f"{self.name}: every resident key is pinned")
                del queue[victim]
            else:
                queue.popitem(last=False)
        queue[key] = None
        return False
