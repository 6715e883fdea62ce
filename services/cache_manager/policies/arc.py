"""ARC (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", FAST'03).

Resident lists T1 (seen once recently) and T2 (seen at least twice), ghost lists B1 and B2 of
keys evicted from them, and a target size p for T1 (c = capacity):

    hit in T1 or T2:  move x to MRU of T2
    miss, x in B1:    p = min(p + max(|B2| / |B1|, 1), c); REPLACE(x); x -> MRU of T2
    miss, x in B2:    p = max(p - max(|B1| / |B2|, 1), 0); REPLACE(x); x -> MRU of T2
    miss, new x (cache full):
        if |T1| + |B1| >= c:
            if |T1| < c: drop LRU of B1; REPLACE(x)
            else:        evict LRU of T1 (no ghost)
        else:
            if |T1| + |T2| + |B1| + |B2| >= 2c: drop LRU of B2
            REPLACE(x)
        x -> MRU of T1
    REPLACE(x): if |T1| > 0 and (|T1| > p or (x in B2 and |T1| == p)):
                    move LRU of T1 to MRU of B1
                else: move LRU of T2 to MRU of B2

p is a real number and its step the real ratio of the ghost list lengths, as in the paper.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Container

from .base import NOTHING_PINNED, EvictionPolicy, Key


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int, params=None) -> None:
        super().__init__(capacity, params)
        # OrderedDicts iterate LRU first; appending puts a key at the MRU end.
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self.p = 0.0
        self._incoming_ghost: int = 0  # 1 or 2 while a ghost hit is being served
        self._evict_t1_without_ghost = False

    def __contains__(self, key: Key) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def on_hit(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        else:
            self.t2.move_to_end(key)

    def on_miss(self, key: Key) -> None:
        c = self.capacity
        if key in self.b1:
            self.p = min(self.p + max(len(self.b2) / len(self.b1), 1.0), c)
            self._incoming_ghost = 1
        elif key in self.b2:
            self.p = max(self.p - max(len(self.b1) / len(self.b2), 1.0), 0.0)
            self._incoming_ghost = 2
        else:
            self._incoming_ghost = 0
            if len(self) < c:
                return
            if len(self.t1) + len(self.b1) >= c:
                if len(self.t1) < c:
                    self.b1.popitem(last=False)
                else:
                    self._evict_t1_without_ghost = True
            elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c:
                self.b2.popitem(last=False)

    def _replace_from_t1(self) -> bool:
        t1 = len(self.t1)
        return t1 > 0 and (t1 > self.p or (t1 == self.p and self._incoming_ghost == 2))

    def victim(self, pinned: Container[Key] = NOTHING_PINNED) -> Key | None:
        first, second = ((self.t1, self.t2) if self._evict_t1_without_ghost
                         or self._replace_from_t1() else (self.t2, self.t1))
        for queue in (first, second):
            for key in queue:
                if key not in pinned:
                    return key
        return None

    def on_evict(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            if not self._evict_t1_without_ghost:
                self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None
        self._evict_t1_without_ghost = False

    def on_insert(self, key: Key) -> None:
        if self._incoming_ghost == 1:
            del self.b1[key]
            self.t2[key] = None
        elif self._incoming_ghost == 2:
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._incoming_ghost = 0
