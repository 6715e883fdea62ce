"""Eviction by a per-expert score that knows the model's layer order (the base of the
layer-aware policies: ``leaststale``, ``nextuse``, ``flashmoe``).

A decode step visits the MoE layers in order, so an expert of layer l_c is next needed no
sooner than ``d = (l_c - l - 1) mod L`` layer steps after the layer l being served now (0 for
the next layer, L-1 for the current one). A policy of this family evicts the resident expert
with the largest

    d(l_c, l) + S[var][c]          (ties: the least recently used)

where S is the policy's own estimate, in layer steps, of how much later than that visit the
expert is needed, refreshed once per token (``refresh``). Variants of S let one refresh serve
the whole token: var 0 for an expert whose layer this token has not reached yet, var 1 for one
whose layer was visited and that was not used, var 2 for one used in this token.

An estimate made elsewhere (the predictor's, ``flashmoe``) is for one decode step, and may
reach the policy after that step began: the policy then knows which step it is for
(``estimate_step``) and which one it serves (``on_request``'s ``step``). ``lag`` = served -
estimated. At 0 the variants are as above. At 1 or more (a new token began before the
estimate for it came) the estimate is of a token already past, whose outcome the policy saw.
An expert used in this token takes var 2; one whose layer this token has not reached, var 2
if used in the estimate's token or since (the distance counted from the token after it),
else var 1 (not used then); one whose layer this token visited without using it, var 3 or
var 4 (the same two, given no use in the token after either: services/predictor/model.py).
At -1 (the estimate for the next token came before that token began) every expert takes var
0 of it. Without step numbers (a worker that does not send them) the estimate is taken as the
current token's.

These policies follow the layer order through the cache manager's core (``on_request`` at the
start of every acquire, ``configure`` with the key space); the per-request replay, which has
neither, cannot run them (``needs_core``).
"""

from __future__ import annotations

from typing import Container

import numpy as np

from .base import NOTHING_PINNED, EvictionPolicy, Key, PolicyError

VARIANTS = 5
TIE_SCALE = float(1 << 32)  # score units in the composite key; the rest orders by recency


class ScoredPolicy(EvictionPolicy):
    needs_core = True

    def __init__(self, capacity: int, params=None) -> None:
        super().__init__(capacity, params)
        self.num_layers = 0
        self.num_experts = 0
        self._len = 0

    # --- key space and position ------------------------------------------------------------

    def configure(self, layers: list[int], num_experts: int) -> None:
        """The key space: (layer, expert) with layer in ``layers`` and expert < num_experts."""
        self.layers = sorted(layers)
        self.num_layers = max(self.layers) + 1
        self.num_experts = num_experts
        n = self.num_layers * num_experts
        self.resident = np.zeros(n, dtype=bool)
        self.last_use = np.zeros(n, dtype=np.float64)  # request clock of the last access
        self.used_token = np.full(n, -1, dtype=np.int64)  # token of the last access
        self.layer_of = np.arange(n) // num_experts
        self.S = np.zeros((VARIANTS, n), dtype=np.float64)
        # Per current layer l: every key's d(layer_c, l), and whether its layer was visited.
        layers_now = np.arange(self.num_layers)[:, None]
        self._d = ((self.layer_of[None, :] - layers_now - 1) % self.num_layers).astype(np.float64)
        self._visited = self.layer_of[None, :] <= layers_now
        # Each key's S variant right now (what ``scores`` selects), kept up to date as the
        # token advances so that ranking gathers one array instead of choosing among them.
        self._est = self.S[0].copy()
        self._visited_end = 0  # keys [0, _visited_end) belong to layers visited this token
        self._early: list[int] = []  # keys used this token before their layer (prefetched)
        self.token = -1
        self.layer = -1
        self.step: int | None = None  # the worker's step of the token served (None: not told)
        self.estimate_step: int | None = None  # the step S is for (None: not told)
        self.clock = 0.0
        self._ranked: list[int] | None = None  # eviction order, best first, for this request
        self._requested: list[int] = []  # the experts of the request being served

    def _index(self, key: Key) -> int:
        layer, expert = key
        return layer * self.num_experts + expert

    def on_request(self, layer: int, experts: list[int] = (), step: int | None = None) -> None:
        """A request for ``experts`` of ``layer`` begins; a new ``step`` (or, without step
        numbers, a layer at or before the last one) starts a token. The request's own experts
        are needed now: none of them is a victim while it is served (the core pins each as it
        comes to it; this covers the rest)."""
        if not self.num_experts:
            raise PolicyError(f"{self.name}: needs the cache manager's core (the layer order "
                              f"and the key space); the per-request replay cannot run it")
        if (step != self.step if step is not None else layer <= self.layer) \
                or self.token < 0:
            self.token += 1
            self.step = step
            self.refresh()
            self._visited_end = 0
            self._early.clear()
            self._update_estimate()
        self.layer = layer
        end = (layer + 1) * self.num_experts
        if end > self._visited_end:  # these layers are visited from now on: not used yet,
            start, self._visited_end = self._visited_end, end  # but for the early ones
            lag = self.lag()
            if lag >= 0:  # (at -1 every key keeps var 0)
                S = self.S
                self._est[start:end] = S[1][start:end] if not lag else np.where(
                    self.used_token[start:end] >= max(self.token - lag, 0), S[3][start:end],
                    S[4][start:end])
                for i in self._early:
                    if start <= i < end:
                        self._est[i] = S[2][i]
        self._requested = [layer * self.num_experts + e for e in experts]
        self._ranked = None

    def lag(self) -> int:
        """Steps by which the estimate is behind the token served (module docstring): 0 when
        it is this token's or either step is unknown; -1 when it is the next token's."""
        if self.step is None or self.estimate_step is None:
            return 0
        lag = self.step - self.estimate_step
        return lag if lag >= -1 else 0  # further ahead: numbering from another run

    def refresh(self) -> None:
        """A new token began: update ``self.S`` (the policy's estimate)."""

    def _select(self, visited: np.ndarray) -> np.ndarray:
        """Each key's S variant, given which keys' layers were visited in this token."""
        S, lag, used = self.S, self.lag(), self.used_token
        now = used == self.token
        if lag > 0:  # used in the estimate's token or since (never used: not)
            since = used >= max(self.token - lag, 0)
            return np.where(now, S[2], np.where(visited, np.where(since, S[3], S[4]),
                                                np.where(since, S[2], S[1])))
        if lag < 0:
            return S[0].copy()
        return np.where(visited, np.where(now, S[2], S[1]), S[0])

    def _update_estimate(self) -> None:
        """Re-select every key's variant (after ``S`` changed outside ``refresh``)."""
        self._est[:] = self._select(np.arange(len(self._est)) < self._visited_end)

    # --- the policy protocol ------------------------------------------------------------------

    def __contains__(self, key: Key) -> bool:
        return bool(self.resident[self._index(key)])

    def __len__(self) -> int:
        return self._len

    def _touch(self, i: int) -> None:
        self.clock += 1.0
        self.last_use[i] = self.clock
        self.used_token[i] = self.token
        lag = self.lag()
        if i < self._visited_end:
            if lag >= 0:  # (at -1 every key keeps var 0)
                self._est[i] = self.S[2][i]
        else:
            self._early.append(i)
            if lag > 0:  # an old estimate gives a key used this token var 2, visited or not
                self._est[i] = self.S[2][i]

    def on_hit(self, key: Key) -> None:
        self._touch(self._index(key))

    def on_insert(self, key: Key) -> None:
        i = self._index(key)
        self.resident[i] = True
        self._len += 1
        self._touch(i)

    def on_prefetch(self, key: Key) -> None:
        """Resident, but not used: its estimate stays that of an expert this token has not
        used (a wrong guess is not kept as if it had been needed)."""
        i = self._index(key)
        self.resident[i] = True
        self._len += 1
        self.clock += 1.0
        self.last_use[i] = self.clock

    def on_evict(self, key: Key) -> None:
        self.resident[self._index(key)] = False
        self._len -= 1

    def scores(self) -> np.ndarray:
        """Every key's eviction score right now (larger = evicted sooner)."""
        return self._d[self.layer] + self._select(self._visited[self.layer])

    def _candidates(self) -> np.ndarray:
        """Residents that may be evicted: not an expert of the request being served."""
        if not self._requested:
            return np.flatnonzero(self.resident)
        mask = self.resident.copy()
        mask[self._requested] = False
        return np.flatnonzero(mask)

    def _rank(self, count: int) -> list[int]:
        """The ``count`` best victims among the residents, best first."""
        idx = self._candidates()
        count = min(count, len(idx))
        if count <= 0:
            return []
        composite = (self._d[self.layer][idx] + self._est[idx]) * TIE_SCALE \
            - self.last_use[idx]
        top = np.argpartition(composite, len(idx) - count)[len(idx) - count:]
        return idx[top[np.argsort(-composite[top], kind="stable")]].tolist()

    def victim(self, pinned: Container[Key] = NOTHING_PINNED) -> Key | None:
        """The best unpinned resident by score. The order is computed once per request: the
        scores of unpinned residents do not change within it (what it touches it pins)."""
        E = self.num_experts
        for count in (len(pinned) + 8 if hasattr(pinned, "__len__") else 8, self._len):
            if self._ranked is None:
                self._ranked = self._rank(count)
            ranked = self._ranked
            while ranked:
                i = ranked.pop(0)
                key = (i // E, i % E)
                if self.resident[i] and key not in pinned:
                    return key
            self._ranked = None
        return None
