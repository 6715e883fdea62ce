"""Belady's MIN (Belady, "A study of replacement algorithms for a virtual-storage computer",
IBM Systems Journal 1966): evict the resident key whose next request is farthest in the future.
The new key is always admitted. It needs the future, so only the trace simulator can run it:
before each request the simulator calls ``set_next_use(t)`` with the position of that key's
next request (``NEVER`` if there is none), or hands it the whole sequence of next uses, in
request order, once (``feed``) when something else (the cache manager's core) makes the calls.

    request x with next use t:  next_use[x] = t; push (-t, x) on a max-heap
    victim:  pop the heap until its top matches a resident key's current next use; O(log n)
"""

from __future__ import annotations

import heapq
from typing import Container

from .base import NOTHING_PINNED, EvictionPolicy, Key, PolicyError

NEVER = 1 << 62


class BeladyPolicy(EvictionPolicy):
    name = "belady"
    needs_future = True

    def __init__(self, capacity: int, params=None) -> None:
        super().__init__(capacity, params)
        self.next_use: dict[Key, int] = {}
        self._heap: list[tuple[int, Key]] = []
        self._pending: int | None = None
        self._future = None

    def set_next_use(self, position: int) -> None:
        self._pending = position

    def feed(self, next_uses) -> None:
        """Next-use positions of every later request, in request order."""
        self._future = iter(next_uses)

    def _record(self, key: Key) -> None:
        position = self._pending
        if position is None:
            if self._future is None:
                raise PolicyError("belady needs the future: call set_next_use() before each "
                                  "request (only the trace simulator can)")
            position = next(self._future)
        self.next_use[key] = position
        heapq.heappush(self._heap, (-position, key))
        self._pending = None
        if len(self._heap) > 4 * len(self.next_use) + 64:  # drop stale entries now and then
            self._heap = [(-t, k) for k, t in self.next_use.items()]
            heapq.heapify(self._heap)

    def __contains__(self, key: Key) -> bool:
        return key in self.next_use

    def __len__(self) -> int:
        return len(self.next_use)

    def on_hit(self, key: Key) -> None:
        self._record(key)

    def on_insert(self, key: Key) -> None:
        self._record(key)

    def victim(self, pinned: Container[Key] = NOTHING_PINNED) -> Key | None:
        heap, next_use, skipped, found = self._heap, self.next_use, [], None
        while heap:
            neg_t, key = heap[0]
            if next_use.get(key) != -neg_t:
                heapq.heappop(heap)  # stale: the key was requested again or evicted
            elif key in pinned:
                skipped.append(heapq.heappop(heap))
            else:
                found = key
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def on_evict(self, key: Key) -> None:
        del self.next_use[key]
