"""CAR: Clock with Adaptive Replacement (Bansal & Modha, FAST'04), as in the paper's Figure 2.

Two clocks T1 and T2 of resident pages with reference bits, two LRU ghost lists B1 and B2, and
an adaptive target p for |T1| (c = capacity). This follows the paper, not libCacheSim's CAR.

    request x:
      if x in T1 or T2: ref(x) = 1                                    (hit)
      else:                                                           (miss)
        if |T1| + |T2| == c:
          replace()
          if x not in B1 or B2 and |T1| + |B1| == c: discard LRU of B1
          elif |T1| + |T2| + |B1| + |B2| == 2c and x not in B1 or B2: discard LRU of B2
        if x not in B1 or B2: x -> tail of T1, ref 0
        elif x in B1: p = min(p + max(1, |B2| / |B1|), c); x -> tail of T2, ref 0
        else:         p = max(p - max(1, |B1| / |B2|), 0); x -> tail of T2, ref 0

    replace():
      loop:
        if |T1| >= max(1, p):
          if ref(head of T1) == 0: demote head of T1 to MRU of B1; done
          else: ref = 0; move head of T1 to tail of T2
        else:
          if ref(head of T2) == 0: demote head of T2 to MRU of B2; done
          else: ref = 0; move head of T2 to tail of T2

p is a real number, as in the paper. Note that the adaptation of p comes *after* replace().
Pinned pages are never chosen; where pins leave the clock that replace() sweeps without a
candidate, the victim is the first unpinned page of either clock (unreferenced first).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Container

from .base import NOTHING_PINNED, EvictionPolicy, Key


class CARPolicy(EvictionPolicy):
    name = "car"

    def __init__(self, capacity: int, params=None) -> None:
        super().__init__(capacity, params)
        # Clocks as OrderedDicts key -> reference bit; the head is the first item.
        self.t1: OrderedDict[Key, bool] = OrderedDict()
        self.t2: OrderedDict[Key, bool] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()  # LRU first
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self.p = 0.0
        self._incoming: Key | None = None

    def __contains__(self, key: Key) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def on_hit(self, key: Key) -> None:
        if key in self.t1:
            self.t1[key] = True
        else:
            self.t2[key] = True

    def on_miss(self, key: Key) -> None:
        self._incoming = key

    def victim(self, pinned: Container[Key] = NOTHING_PINNED) -> Key | None:
        """The paper's replace() up to the demotion: the clock hands sweep (clearing
        reference bits, moving T1 pages to T2), then the page to demote is returned."""
        budget = 4 * (len(self.t1) + len(self.t2)) + 4  # bounds the sweep when all are pinned
        while budget > 0 and (self.t1 or self.t2):
            budget -= 1
            if self.t1 and len(self.t1) >= max(1.0, self.p):
                key, ref = next(iter(self.t1.items()))
                if not ref and key not in pinned:
                    return key
                del self.t1[key]
                self.t2[key] = False
            else:
                key, ref = next(iter(self.t2.items()))
                if not ref and key not in pinned:
                    return key
                self.t2.move_to_end(key)
                self.t2[key] = False
        # Pins can block the paper's choice (e.g. T1 below p and every page of T2 pinned):
        # then the first unpinned page of either clock, unreferenced ones first.
        candidates = [key for clock in (self.t1, self.t2) for key in clock if key not in pinned]
        unreferenced = [key for key in candidates if not (self.t1.get(key) or self.t2.get(key))]
        return (unreferenced or candidates or [None])[0]

    def on_evict(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None
        x = self._incoming
        if x is None or x in self.b1 or x in self.b2:
            return
        c = self.capacity
        if len(self.t1) + len(self.b1) == c:
            self.b1.popitem(last=False)
        elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) == 2 * c:
            self.b2.popitem(last=False)

    def on_insert(self, key: Key) -> None:
        c = self.capacity
        if key in self.b1:
            self.p = min(self.p + max(1.0, len(self.b2) / len(self.b1)), c)
            del self.b1[key]
            self.t2[key] = False
        elif key in self.b2:
            self.p = max(self.p - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            del self.b2[key]
            self.t2[key] = False
        else:
            self.t1[key] = False
        self._incoming = None
