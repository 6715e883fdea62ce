"""LFU: evict the resident key with the fewest hits since it was inserted; ties go to the
least recently used of them (frequency buckets of LRU lists, O(1) per request).

    on insert: freq[x] = 1, append x to bucket 1
    on hit:    move x from bucket f to the MRU end of bucket f + 1
    victim:    the LRU unpinned key of the lowest non-empty bucket
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Container

from .base import NOTHING_PINNED, EvictionPolicy, Key


class LFUPolicy(EvictionPolicy):
    name = "lfu"

    def __init__(self, capacity: int, params=None) -> None:
        super().__init__(capacity, params)
        self._freq: dict[Key, int] = {}
        self._buckets: dict[int, OrderedDict[Key, None]] = {}
        self._min_freq = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def _unlink(self, key: Key) -> int:
        freq = self._freq[key]
        bucket = self._buckets[freq]
        del bucket[key]
        if not bucket:
            del self._buckets[freq]
            if self._min_freq == freq:
                self._min_freq = freq + 1
        return freq

    def on_hit(self, key: Key) -> None:
        freq = self._unlink(key) + 1
        self._freq[key] = freq
        self._buckets.setdefault(freq, OrderedDict())[key] = None

    def on_insert(self, key: Key) -> None:
        self._freq[key] = 1
        self._buckets.setdefault(1, OrderedDict())[key] = None
        self._min_freq = 1

    def victim(self, pinned: Container[Key] = NOTHING_PINNED) -> Key | None:
        if not pinned and self._freq:
            while self._min_freq not in self._buckets:
                self._min_freq += 1
            return next(iter(self._buckets[self._min_freq]))
        for freq in sorted(self._buckets):
            for key in self._buckets[freq]:
                if key not in pinned:
                    return key
        return None

    def on_evict(self, key: Key) -> None:
        self._unlink(key)
        del self._freq[key]
