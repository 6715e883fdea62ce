"""FlashMoE: evict the expert that the learned predictor expects to need last.

    score(c) = d(layer_c, l) + S[var][c]      evict the largest (ties: LRU); see scored.py

S comes from the predictor (services/predictor: next-use distance of every expert, as a
bucket distribution, turned into layer steps), delivered with ``set_estimate`` about every
``predictor.publish_interval_ms``. Without an estimate, or with one older than the cache
manager's ``predictor.max_age_ms`` (it calls ``set_estimate(None)``), the policy falls back to
LRU and says so (``fallback``).

``hybrid_share`` > 0 selects a hybrid instead: the best-scored share of the residents
is kept, the rest is evicted in LRU order (an ablation; evicting by the score alone measures
better on the dev split).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import PolicyError
from .scored import TIE_SCALE, VARIANTS, ScoredPolicy


@dataclass(frozen=True)
class FlashMoEParams:
    hybrid_share: float = 0.0  # 0: by score alone; else the share kept by score, LRU for the rest

    def check(self) -> None:
        if not 0.0 <= self.hybrid_share < 1.0:
            raise PolicyError(f"flashmoe: hybrid_share {self.hybrid_share} must be in [0, 1)")


class FlashMoEPolicy(ScoredPolicy):
    name = "flashmoe"
    Params = FlashMoEParams
    accepts_estimates = True

    def configure(self, layers: list[int], num_experts: int) -> None:
        super().configure(layers, num_experts)
        self.fallback = True  # no estimate yet
        self.estimates = 0  # estimates received

    def set_estimate(self, S: np.ndarray | None, layers: list[int] | None = None,
                     step: int | None = None) -> None:
        """S (VARIANTS, len(layers) * E): row block i belongs to layer ``layers[i]``
        (default: the policy's layers in order); ``step``: the decode step it is for, in the
        numbering of ``on_request``'s steps (None: not known; scored.py says what it
        changes). Three rows give the first three variants, vars 3 and 4 then taken as 2 and
        1. None: no usable estimate, LRU until the next one."""
        self._ranked = None
        if S is None:
            self.fallback = True
            return
        layers = self.layers if layers is None else layers
        E = self.num_experts
        if S.ndim != 2 or S.shape[0] not in (3, VARIANTS) or S.shape[1] != len(layers) * E:
            raise ValueError(f"flashmoe: an estimate of shape {S.shape}, expected "
                             f"{(VARIANTS, len(layers) * E)}")
        if len(S) == 3:
            S = S[[0, 1, 2, 2, 1]]
        for i, layer in enumerate(layers):
            self.S[:, layer * E:(layer + 1) * E] = S[:, i * E:(i + 1) * E]
        self.estimate_step = step
        self._update_estimate()
        self.fallback = False
        self.estimates += 1

    def can_look_ahead(self) -> bool:
        """A usable estimate and a full cache (while it fills there is no victim to weigh a
        look-ahead load against)."""
        return not self.fallback and self._len >= self.capacity

    def wanted(self, count: int, margin: float = 0.0, ratio: float = 1.0, skip: int = 0
               ) -> list[tuple[int, int]]:
        """Look-ahead prefetch: up to ``count`` experts, neither resident nor loading, whose
        score (expected next use, in layer steps from now) is at most 1/``ratio`` of the best
        victim's and lower by at least ``margin`` tokens, soonest needed first; none of the
        next ``skip`` layers (a read started now would still be in flight when they ask).
        None without a usable estimate."""
        if count <= 0 or not self.can_look_ahead():
            return []
        d = self._d[self.layer]
        here = d + self._est
        victims = self._candidates()
        if not len(victims):
            return []
        bar = here[victims].max() / ratio - margin * self.num_layers
        outside = np.flatnonzero(~self.resident & (here < bar) & (d >= skip))
        if not len(outside):
            return []
        best = outside[np.argsort(here[outside], kind="stable")[:count]]
        E = self.num_experts
        return [(int(i) // E, int(i) % E) for i in best]

    def _rank(self, count: int) -> list[int]:
        if self.fallback:
            idx = self._candidates()
            order = np.argsort(self.last_use[idx], kind="stable")[:count]
            return idx[order].tolist()
        share = self.params.hybrid_share
        if not share:
            return super()._rank(count)
        idx = self._candidates()
        score = self.scores()[idx] * TIE_SCALE - self.last_use[idx]
        kept = int(share * len(idx))
        exposed = idx[np.argsort(score, kind="stable")[kept:]]  # the lowest scores are kept
        return exposed[np.argsort(self.last_use[exposed], kind="stable")][:count].tolist()
