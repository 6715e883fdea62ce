"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

A small FIFO S (``small_ratio`` of the capacity), a main FIFO M (the rest), a ghost FIFO G of
recently evicted keys (``ghost_ratio`` of the capacity), and an access count per resident key
(M treats it as a 2-bit counter). Details the paper leaves open follow libCacheSim's
implementation, except that the small FIFO holds at least one key here, where libCacheSim
refuses a cache whose small FIFO would be empty:

    hit:          freq[x] += 1
    miss:         make room; insert x into M if x in G (leaving G), else into S (into M
                  while S is full and nothing was ever evicted: the warm-up); freq[x] = 0
    make room:    if |M| > main capacity or S is empty: evictM() else evictS()
    evictS():     loop: t = oldest of S
                    if freq[t] >= move_to_main_threshold: t -> M, freq 0 (M may overfill;
                                                          the next eviction then takes from M)
                    else: t -> G, evicted; done
                  if S empties without an eviction: evictM()
    evictM():     loop: t = oldest of M
                    if freq[t] > 0: freq[t] = min(freq[t], 3) - 1; t reinserted at M's head
                    else: evicted; done
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Container

from .base import NOTHING_PINNED, EvictionPolicy, Key, PolicyError


@dataclass(frozen=True)
class S3FIFOParams:
    small_ratio: float = 0.1  # share of the capacity for the small FIFO
    ghost_ratio: float = 0.9  # ghost FIFO length, times the capacity
    move_to_main_threshold: int = 2  # hits in S needed to be promoted to M

    def check(self) -> None:
        if not 0.0 < self.small_ratio < 1.0:
            raise PolicyError(f"s3fifo: small_ratio {self.small_ratio} must be in (0, 1)")
        if self.ghost_ratio < 0:
            raise PolicyError(f"s3fifo: ghost_ratio {self.ghost_ratio} must be >= 0")
        if self.move_to_main_threshold < 1:
            raise PolicyError("s3fifo: move_to_main_threshold must be >= 1")


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"
    Params = S3FIFOParams

    def __init__(self, capacity: int, params: S3FIFOParams | None = None) -> None:
        super().__init__(capacity, params)
        self.small_capacity = max(1, int(capacity * self.params.small_ratio))
        self.main_capacity = max(1, capacity - self.small_capacity)
        self.ghost_capacity = int(capacity * self.params.ghost_ratio)
        self.small: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self.main: OrderedDict[Key, None] = OrderedDict()
        self.ghost: OrderedDict[Key, None] = OrderedDict()
        self.freq: dict[Key, int] = {}
        self.has_evicted = False

    def __contains__(self, key: Key) -> bool:
        return key in self.freq

    def __len__(self) -> int:
        return len(self.freq)

    def on_hit(self, key: Key) -> None:
        self.freq[key] += 1

    def on_insert(self, key: Key) -> None:
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        elif not self.has_evicted and len(self.small) >= self.small_capacity:
            self.main[key] = None  # warm-up: S is full, nothing evicted yet
        else:
            self.small[key] = None
        self.freq[key] = 0

    def _from_main(self, pinned: Container[Key]) -> Key | None:
        main, freq = self.main, self.freq
        for _ in range(4 * len(main) + 1):  # min(freq, 3) - 1 per pass: four clear every key
            if not main:
                return None
            key = next(iter(main))
            if freq[key] > 0 or key in pinned:
                freq[key] = max(min(freq[key], 3) - 1, 0)
                main.move_to_end(key)
            else:
                return key
        return None

    def victim(self, pinned: Container[Key] = NOTHING_PINNED) -> Key | None:
        """Runs the queue moves of evictS/evictM and returns the key they evict."""
        self.has_evicted = True
        if len(self.main) <= self.main_capacity and self.small:
            for _ in range(len(self.small)):
                key = next(iter(self.small))
                if self.freq[key] >= self.params.move_to_main_threshold:
                    del self.small[key]
                    self.main[key] = None
                    self.freq[key] = 0
                elif key in pinned:
                    self.small.move_to_end(key)
                else:
                    return key
        victim = self._from_main(pinned)
        if victim is None:  # everything in M is pinned: fall back to S
            victim = next((key for key in self.small if key not in pinned), None)
        return victim

    def on_evict(self, key: Key) -> None:
        del self.freq[key]
        if key in self.small:
            del self.small[key]
            if self.ghost_capacity:
                self.ghost[key] = None
                if len(self.ghost) > self.ghost_capacity:
                    self.ghost.popitem(last=False)
        else:
            del self.main[key]
