"""Least-Stale (SpecMD, arXiv 2602.03921): evict the expert whose layer this token visited
most recently; among those, the least recently used.

    score(c) = d(layer_c, l) = (layer_c - l - 1) mod L      evict the largest (ties: LRU)

An expert of the layer just served is needed again no sooner than the next token, one of the
next layer right away; Least-Stale keeps no estimate of its own (S = 0, see scored.py).

With no estimate the order needs no scores: the victim is the least recently used unpinned
expert of the current layer, else of the layer before, and so on round the layers. One LRU
list per layer finds it without ranking every resident (the same victims as scored.py's
ranking, which the tests check).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Container

from .base import NOTHING_PINNED, Key
from .scored import ScoredPolicy


class LeastStalePolicy(ScoredPolicy):
    name = "leaststale"

    def configure(self, layers: list[int], num_experts: int) -> None:
        super().configure(layers, num_experts)
        self._lru: list[OrderedDict[int, None]] = [OrderedDict()
                                                   for _ in range(self.num_layers)]

    def on_hit(self, key: Key) -> None:
        super().on_hit(key)
        self._lru[key[0]].move_to_end(key[1])

    def on_insert(self, key: Key) -> None:
        super().on_insert(key)
        self._lru[key[0]][key[1]] = None

    def on_evict(self, key: Key) -> None:
        super().on_evict(key)
        del self._lru[key[0]][key[1]]

    def victim(self, pinned: Container[Key] = NOTHING_PINNED) -> Key | None:
        L, E, layer = self.num_layers, self.num_experts, self.layer
        requested = self._requested
        for step in range(L):  # d = L - 1 - step: the largest first
            lc = (layer - step) % L
            for expert in self._lru[lc]:  # least recently used first
                key = (lc, expert)
                if key not in pinned and lc * E + expert not in requested:
                    return key
        return None
