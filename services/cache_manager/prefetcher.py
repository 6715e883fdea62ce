"""The inline next-layer prefetcher: from the layers a token has routed so far (and its input
token), which experts will the next layer want? Learned online by the cache manager itself,
from the requests it serves.

Statistics (counts, updated when a token's last layer is served):
  token_uses[x][m][e]     routing that followed input token x (the token's context)
  after_prev[m][j][e]     expert j at layer m - 1 -> expert e at layer m, same token
  after_prev2[m][j][e]    expert j at layer m - 2 -> expert e at layer m
  freq[m][e]              usage decayed with a half-life of 8 tokens
  used_last[m][e]         used by the previous token
Features of a candidate (m, e) once layer m - 1 is routed: log P(e | token), log mean_j
P(e | j at m - 1), log mean_j P(e | j at m - 2), log freq, used_last (every P smoothed towards
the long-run frequency with weight ``alpha``); logit = w . features + b[m], with w learned
online by logistic SGD.

The token table is bounded: at most ``max_token_rows`` input tokens keep a row (about
``TOKEN_TABLE_BYTES`` in all, between ``MIN_TOKEN_ROWS`` and ``MAX_TOKEN_ROWS`` rows); past that
the token learned from least recently gives its row to the new one (an LRU of rows), so a
vocabulary of any size costs a fixed amount of memory while one that fits behaves as if
unbounded. A worker's token in progress is dropped when the worker goes (``worker_gone``).

After a worker's request for layer l it hints the experts of layer l + 1 whose probability
reaches ``threshold`` (at most ``per_layer``), so that a wrong guess costs little SSD traffic;
the cache manager loads them within the prefetch budget and the free queue depth.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

FEATURES = 5
TOKEN_TABLE_BYTES = 64 << 20  # the token table's budget
MIN_TOKEN_ROWS, MAX_TOKEN_ROWS = 1024, 65536


@dataclass(frozen=True)
class PrefetcherParams:
    threshold: float = 0.55  # hint an expert whose predicted chance of use reaches this
    per_layer: int = 4  # most experts hinted per layer
    alpha: float = 1.0  # weight of the long-run frequency in every smoothed estimate
    lr: float = 0.02


class NextLayerPrefetcher:
    def __init__(self, num_layers: int, num_experts: int, top_k: int,
                 params: PrefetcherParams = PrefetcherParams()) -> None:
        self.L, self.E, self.K = num_layers, num_experts, top_k
        self.params = params
        L, E = num_layers, num_experts
        # token -> its row, least recently learned from first
        self.token_row: OrderedDict[str, int] = OrderedDict()
        self.max_token_rows = min(MAX_TOKEN_ROWS, max(MIN_TOKEN_ROWS,
                                                      TOKEN_TABLE_BYTES // (4 * L * E)))
        self.token_uses = np.zeros((min(256, self.max_token_rows), L, E), np.float32)
        self.token_seen = np.zeros(len(self.token_uses), np.float32)
        self.after_prev = np.zeros((L, E, E), np.float32)
        self.prev_seen = np.zeros((L, E), np.float32)
        self.after_prev2 = np.zeros((L, E, E), np.float32)
        self.prev2_seen = np.zeros((L, E), np.float32)
        self.decay = 0.5 ** (1 / 8)
        self.freq = np.full((L, E), top_k / E, np.float32)
        self.slow = np.full((L, E), top_k / E, np.float32)
        self.used_last = np.zeros((L, E), np.float32)
        self.w = np.array([1.0, 1.0, 0.5, 0.3, 0.3], np.float32)
        self.b = np.zeros(L, np.float32)
        self.stats = {"hints": 0, "tokens": 0}
        self._streams: dict = {}  # per worker: the current token's routing and features

    def reset(self) -> None:
        """Forget the tokens in progress (the statistics stay)."""
        self._streams.clear()

    def worker_gone(self, worker) -> None:
        """Forget a worker's token in progress (it went away)."""
        self._streams.pop(worker, None)

    def sizes(self) -> dict[str, int]:
        """How full its tables are: token rows held, workers with a token in progress."""
        return {"prefetcher_token_rows": len(self.token_row),
                "prefetcher_streams": len(self._streams)}

    # --- the stream of served requests ------------------------------------------------------

    def after_request(self, core, worker, layer: int, experts: list[int], token: str = "",
                      layer_ids: list[int] | None = None, hint: bool = True) -> list[int]:
        """A worker's request for MoE layer ``layer`` (its position among the MoE layers) was
        served: learn, and (``hint``) hint the next layer to ``core`` (``core.hint`` with the
        layer's id, ``layer_ids[position]`` when the MoE layers are not numbered 0..L-1).
        Returns the experts hinted."""
        stream = self._streams.get(worker)
        if stream is None or layer <= stream["layer"]:
            if stream is not None and stream["layer"] == self.L - 1:
                self._learn(stream)
            stream = self._streams[worker] = {"layer": -1, "token": token,
                                              "routing": np.full((self.L, self.K), -1, np.int64),
                                              "X": {}}
        stream["layer"] = layer
        stream["routing"][layer, :len(experts)] = experts[:self.K]
        if layer == self.L - 1:
            return []
        X = self._features(stream, layer + 1)
        stream["X"][layer + 1] = X  # (learned from at the token's end, hinted or not)
        if not hint:
            return []
        p = 1.0 / (1.0 + np.exp(-(X @ self.w + self.b[layer + 1])))
        order = np.argsort(-p)[:self.params.per_layer]
        hinted = [int(e) for e in order if p[e] >= self.params.threshold]
        if hinted:
            core.hint(layer + 1 if layer_ids is None else layer_ids[layer + 1], hinted)
            self.stats["hints"] += len(hinted)
        return hinted

    def _row(self, token: str) -> int | None:
        return self.token_row.get(token)

    def _token_row_to_learn(self, token: str) -> int:
        """The token's row, made most recently used; a new token gets a fresh row (the table
        doubles up to ``max_token_rows``) or, when full, the least recently used one's."""
        rows = self.token_row
        row = rows.get(token)
        if row is not None:
            rows.move_to_end(token)
            return row
        if len(rows) < self.max_token_rows:
            row = len(rows)
            if row >= len(self.token_seen):
                grow = min(len(self.token_seen), self.max_token_rows - len(self.token_seen))
                self.token_uses = np.concatenate(
                    [self.token_uses, np.zeros((grow, *self.token_uses.shape[1:]), np.float32)])
                self.token_seen = np.concatenate([self.token_seen, np.zeros(grow, np.float32)])
        else:
            _, row = rows.popitem(last=False)
            self.token_uses[row] = 0.0
            self.token_seen[row] = 0.0
        rows[token] = row
        return row

    def _features(self, stream: dict, m: int) -> np.ndarray:
        a, prior = self.params.alpha, self.slow[m]
        X = np.empty((self.E, FEATURES), np.float32)
        row = self._row(stream["token"])
        tab = prior if row is None else \
            (self.token_uses[row, m] + a * prior) / (self.token_seen[row] + a)
        X[:, 0] = np.log(tab + 1e-4)
        X[:, 1] = self._transition(self.after_prev[m], self.prev_seen[m],
                                   stream["routing"][m - 1], prior)
        X[:, 2] = (self._transition(self.after_prev2[m], self.prev2_seen[m],
                                    stream["routing"][m - 2], prior)
                   if m >= 2 else X[:, 1])
        X[:, 3] = np.log(self.freq[m] + 1e-4)
        X[:, 4] = self.used_last[m]
        return X

    def _transition(self, counts, seen, sources, prior) -> np.ndarray:
        sources = sources[sources >= 0]
        if not len(sources):
            return np.log(prior + 1e-4)
        a = self.params.alpha
        return np.log(((counts[sources] + a * prior) / (seen[sources][:, None] + a)).mean(0)
                      + 1e-4)

    def _learn(self, stream: dict) -> None:
        """A whole token was served: a logistic SGD step on what was predicted, then count."""
        routing = stream["routing"]
        L, E, K = self.L, self.E, self.K
        used = np.zeros((L, E), np.float32)
        used[np.arange(L)[:, None], routing] = 1.0
        lr = self.params.lr
        for m, X in stream["X"].items():
            p = 1.0 / (1.0 + np.exp(-(X @ self.w + self.b[m])))
            g = p - used[m]
            self.w -= lr * (g @ X) / E * 8
            self.b[m] -= lr * g.mean() * 8
        row = self._token_row_to_learn(stream["token"])
        self.token_uses[row] += used
        self.token_seen[row] += 1
        for counts, seen, lag in ((self.after_prev, self.prev_seen, 1),
                                  (self.after_prev2, self.prev2_seen, 2)):
            m = np.arange(lag, L)
            layer = np.repeat(m, K * K)
            src = np.repeat(routing[m - lag], K, axis=1).reshape(-1)
            dst = np.tile(routing[m], (1, K)).reshape(-1)
            np.add.at(counts, (layer, src, dst), 1.0)
            np.add.at(seen, (np.repeat(m, K), routing[m - lag].reshape(-1)), 1.0)
        self.freq = self.decay * self.freq + (1 - self.decay) * used
        self.slow = 0.999 * self.slow + 0.001 * used
        self.used_last = used
        self.stats["tokens"] += 1
