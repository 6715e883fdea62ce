"""Least-Stale (SpecMD, arXiv 2602.03921): evict the expert whose layer this token visited
most recently; among those, the least recently used.

    score(c) = d(layer_c, l) = (layer_c - l - 1) mod L      evict the largest (ties: LRU)

An expert of the layer just served is needed again no sooner than the next token, one of the
next layer right away; Least-Stale keeps no estimate of its own (S = 0, see scored.py).
"""

from __future__ import annotations

from .scored import ScoredPolicy


class LeastStalePolicy(ScoredPolicy):
    name = "leaststale"
