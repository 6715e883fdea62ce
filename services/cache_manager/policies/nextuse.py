"""nextuse: the expected-next-use heuristic. An expert used at a rate q per token is needed
about 1/q tokens after its layer comes again, so evict the largest

    d(layer_c, l) + L * (1 - p) / q,     p = q = decayed usage frequency of c

with q an exponentially decayed per-token usage indicator (``half_life`` tokens), ``eps``
keeping 1/q finite. Refreshed at each token start from the token before; for an expert whose
layer this token already visited, q includes this token's outcome (used or not: the variants
of scored.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import PolicyError
from .scored import ScoredPolicy


@dataclass(frozen=True)
class NextUseParams:
    half_life: float = 8.0  # tokens for the usage frequency to decay by half
    eps: float = 1e-3  # floor of q

    def check(self) -> None:
        if not self.half_life > 0 or not 0 < self.eps < 1:
            raise PolicyError(f"nextuse: half_life {self.half_life} must be > 0 and eps "
                              f"{self.eps} in (0, 1)")


class NextUsePolicy(ScoredPolicy):
    name = "nextuse"
    Params = NextUseParams

    def configure(self, layers: list[int], num_experts: int) -> None:
        super().configure(layers, num_experts)
        self.q = np.zeros(self.num_layers * num_experts)
        self.decay = 0.5 ** (1.0 / self.params.half_life)

    def _estimate(self, q: np.ndarray) -> np.ndarray:
        return self.num_layers * (1.0 - q) / np.maximum(q, self.params.eps)

    def refresh(self) -> None:
        lam = self.decay
        if self.token > 0:
            used = (self.used_token == self.token - 1).astype(np.float64)
            self.q = lam * self.q + (1.0 - lam) * used
        self.S[0] = self._estimate(self.q)
        self.S[1] = self._estimate(lam * self.q)
        self.S[2] = self._estimate(lam * self.q + (1.0 - lam))
