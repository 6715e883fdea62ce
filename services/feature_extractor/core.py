"""The feature extractor's core: locality features of every expert, one refresh per token.

Fed the access stream token by token (``observe``: one token's routing; ``step``: the next
token's input token and position), it describes every expert (key = layer * E + expert) for
the token about to run, from the past only:

  temporal   used at t-1 and t-2, router probability at t-1, usage frequency decayed with
             half-lives of 2, 8 and 64 tokens, recency, last reuse gap and its running mean
  spatial    the layer's transition from the experts it used at t-1 (learned counts)
  context    tables keyed by the input token (exact text) and by a SimHash fingerprint of the
             last three input tokens: how often each expert ran with that context, and in the
             token that followed it (next one, next four); position in the sequence

The token tables hold at most ``max_token_rows`` rows (``ExtractorParams``): past that, the
least recently seen token's row is cleared and reused (an LRU of rows), so a real vocabulary
costs a bounded table (16,384 rows cover the shared gpt-oss-20b traces' 10,460 distinct tokens:
there nothing is ever evicted). The SimHash bits of a token are cached the same way.

Every table estimate is smoothed towards the expert's long-run frequency (``alpha``), so an
unseen context says "as usual". The per-layer raw vector (the layer's experts x ``RAW``
features, 256 numbers for 32 experts) is reduced by an online PCA (``OnlinePCA``) that reports
the variance it keeps.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from common.checkpoints import (CheckpointDamaged, CheckpointMismatch, read_checkpoint,
                                write_durably,
                                write_text_durably)

from common.checks import check_probs, check_routing

# The per-expert features, in their column order (the FeatureBatch's per_expert rows).
FEATURES = ("used_last", "prob_last", "recent_freq", "medium_freq", "long_run_freq", "recency",
            "last_gap", "mean_gap", "token", "context", "transition", "position", "next",
            "next4", "used_before_last")
RAW = ("used_last", "prob_last", "recent_freq", "medium_freq", "long_run_freq", "recency",
       "token", "transition")  # the per-layer raw vector
# The usage frequencies' half-lives in tokens.
FREQUENCY_HALF_LIVES = {"recent_freq": 2, "medium_freq": 8, "long_run_freq": 64}
# The tables with one row per input token seen (they grow with the vocabulary met).
ROW_TABLES = ("token_uses", "token_seen", "next_uses", "next_seen", "next4_uses", "next4_seen")
LOG_CAP = 10.0
NEVER = -(10 ** 9)


def _log_feature(gap: np.ndarray) -> np.ndarray:
    """A reuse gap in tokens as a feature in [0, 1]: log2(1 + gap), capped, scaled."""
    return np.minimum(np.log2(1 + gap), LOG_CAP) / LOG_CAP


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"),
                                          digest_size=8).digest(), "little")


@lru_cache(maxsize=1 << 16)
def _token_bits(token: str, bits: int) -> tuple[float, ...]:
    """A token's SimHash votes: +1 / -1 for each of the first ``bits`` bits of its hash."""
    h = _hash64(token)
    return tuple(1.0 if (h >> i) & 1 else -1.0 for i in range(bits))


@dataclass(frozen=True)
class ExtractorParams:
    alpha: float = 2.0  # weight of the long-run frequency smoothing every table estimate
    simhash_bits: int = 12
    window: tuple[float, ...] = (0.5, 0.7, 1.0)  # SimHash weights of x_{t-2}, x_{t-1}, x_t
    max_token_rows: int = 16384  # rows of the token tables (an LRU of input tokens)

    def __post_init__(self) -> None:
        if self.max_token_rows < 8:  # the last four input tokens' rows must stay
            raise ValueError(f"max_token_rows {self.max_token_rows}: at least 8")


class FeatureExtractor:
    """Per-expert features for the next token, from the routing seen so far."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int,
                 params: ExtractorParams = ExtractorParams()) -> None:
        self.L, self.E, self.K = num_layers, num_experts, top_k
        self.N = N = num_layers * num_experts
        self.params = params
        self.t = 0  # tokens observed
        # usage frequencies (an exponential moving average of "used in this token") by name,
        # each decayed with its half-life in tokens; the long-run one is the prior every table
        # estimate is smoothed towards
        self.decay = {name: 0.5 ** (1.0 / h) for name, h in FREQUENCY_HALF_LIVES.items()}
        self.recent_freq = np.zeros(N, np.float32)
        self.medium_freq = np.zeros(N, np.float32)
        self.long_run_freq = np.zeros(N, np.float32)
        self.used_last = np.zeros(N, np.float32)  # 1 where the key ran in token t - 1
        self.used_before_last = np.zeros(N, np.float32)  # ... in token t - 2
        self.prob_last = np.zeros(N, np.float32)  # its router probability in token t - 1
        self.last_use = np.full(N, NEVER, np.int64)  # the token it last ran in
        self.last_gap = np.full(N, 2.0 ** LOG_CAP, np.float32)  # tokens between its last uses
        self.mean_gap = np.full(N, 2.0 ** LOG_CAP, np.float32)  # their running mean
        # input token -> its row of the token tables, least recently seen first
        self.token_row: OrderedDict[str, int] = OrderedDict()
        rows = min(1024, params.max_token_rows)
        # input token (its row) -> how often each key ran in a token with that input, and how
        # many such tokens there were
        self.token_uses = np.zeros((rows, N), np.float32)
        self.token_seen = np.zeros(rows, np.float32)
        self.next_uses = np.zeros((rows, N), np.float32)  # ... in the token that followed it
        self.next_seen = np.zeros(rows, np.float32)
        self.next4_uses = np.zeros((rows, N), np.float32)  # ... in the next four (their mean)
        self.next4_seen = np.zeros(rows, np.float32)
        bits = params.simhash_bits
        # the same for the SimHash fingerprint of the last three input tokens
        self.context_uses = np.zeros((1 << bits, N), np.float32)
        self.context_seen = np.zeros(1 << bits, np.float32)
        # per layer: times expert i at t - 1 was followed by expert j at t, and times expert i
        # was the source of a transition
        self.transition_counts = np.zeros((num_layers, num_experts, num_experts), np.float32)
        self.transition_sources = np.zeros((num_layers, num_experts), np.float32)
        self.prev_experts: np.ndarray | None = None
        self.history: list[str] = []  # input tokens of this sequence (the SimHash window)
        self.rows_history: list[int] = []  # table rows of its last four input tokens
        self.row = -1
        self.ctx = -1
        self.position = 0
        self.stepped = False  # step() was called for the token observe() will record
        self._layer_index = np.arange(num_layers)
        self._layer_base = (self._layer_index * num_experts)[:, None]
        self._pair_layer = np.repeat(self._layer_index, top_k * top_k)  # transitions' indices
        self._src_layer = np.repeat(self._layer_index, top_k)
        # log-scaled reuse gaps, kept as features (they change only where a key is used)
        self.last_gap_feature = np.ones(N, np.float32)
        self.mean_gap_feature = np.ones(N, np.float32)

    # --- context tables ----------------------------------------------------------------------

    def fingerprint(self, tokens: list[str]) -> int:
        """SimHash of the recent input tokens (weighted, the newest heaviest): bit i is set
        when the weighted vote of the tokens' hash bits i is positive. (Plain Python: three
        tokens of 12 bits cost less than numpy's dispatch.)"""
        bits = self.params.simhash_bits
        acc = [0.0] * bits
        for weight, token in zip(self.params.window[-len(tokens):], tokens):
            acc = [a + weight * b for a, b in zip(acc, _token_bits(token, bits))]
        return sum(1 << i for i, a in enumerate(acc) if a > 0)

    def _row_of(self, token: str) -> int:
        row = self.token_row.get(token)
        if row is not None:
            self.token_row.move_to_end(token)
            return row
        if len(self.token_row) >= self.params.max_token_rows:
            _, row = self.token_row.popitem(last=False)  # the least recently seen token's
            for name in ROW_TABLES:
                getattr(self, name)[row] = 0
        else:
            row = len(self.token_row)
            if row >= len(self.token_seen):
                grown = min(2 * len(self.token_seen), self.params.max_token_rows)
                for name in ROW_TABLES:
                    table = getattr(self, name)
                    bigger = np.zeros((grown,) + table.shape[1:], table.dtype)
                    bigger[:len(table)] = table
                    setattr(self, name, bigger)
        self.token_row[token] = row
        return row

    # --- the stream ----------------------------------------------------------------------------

    def step(self, token: str, position: int) -> np.ndarray:
        """Features (N, len(FEATURES)) of the token about to run: its input ``token``, its
        ``position`` in the sequence (0 starts a new sequence)."""
        if position == 0:
            self.history, self.rows_history = [], []
        self.history = (self.history + [token])[-len(self.params.window):]
        self.position = position
        a = self.params.alpha
        prior = self.long_run_freq
        ap = a * prior  # the prior's weight in every table estimate
        X = np.empty((self.N, len(FEATURES)), np.float32)
        X[:, 0] = self.used_last
        X[:, 1] = self.prob_last
        X[:, 2] = self.recent_freq
        X[:, 3] = self.medium_freq
        X[:, 4] = prior
        since = np.maximum(self.t - self.last_use, 1).astype(np.float32)
        X[:, 5] = np.minimum(np.log2(since), LOG_CAP) / LOG_CAP
        X[:, 6] = self.last_gap_feature
        X[:, 7] = self.mean_gap_feature
        row = self.row = self._row_of(token)
        X[:, 8] = (self.token_uses[row] + ap) / (self.token_seen[row] + a)
        ctx = self.ctx = self.fingerprint(self.history)
        X[:, 9] = (self.context_uses[ctx] + ap) / (self.context_seen[ctx] + a)
        if self.prev_experts is not None:
            rows = self._layer_index[:, None]
            counts = self.transition_counts[rows, self.prev_experts]  # (L, K, E)
            seen = self.transition_sources[rows, self.prev_experts][..., None]
            smoothed = (counts + ap.reshape(self.L, 1, self.E)) / (seen + a)
            X[:, 10] = (smoothed.sum(1) / self.K).reshape(self.N)  # the mean over the K
        else:
            X[:, 10] = prior
        X[:, 11] = min(np.log2(1 + min(position, 1 << 40)), LOG_CAP) / LOG_CAP  # any int
        X[:, 12] = (self.next_uses[row] + ap) / (self.next_seen[row] + a)
        X[:, 13] = (self.next4_uses[row] + ap) / (self.next4_seen[row] + a)
        X[:, 14] = self.used_before_last
        self.stepped = True
        return X

    def observe(self, experts: np.ndarray, probs: np.ndarray | None = None) -> None:
        """The routing of the token just stepped: ``experts`` (L, K) ids, ``probs`` (L, K)."""
        if not self.stepped:
            raise RuntimeError("observe() needs step() for the same token first")
        self.stepped = False
        K = self.K
        experts = np.asarray(experts, np.int64)
        keys = (experts + self._layer_base).reshape(-1)  # distinct: a layer's top-k are
        used = np.zeros(self.N, np.float32)
        used[keys] = 1.0
        for name, lam in self.decay.items():  # freq = lam * freq + (1 - lam) * used
            freq = getattr(self, name)
            freq *= lam
            freq[keys] += np.float32(1 - lam)
        self.used_before_last, self.used_last = self.used_last, used
        self.prob_last = np.zeros(self.N, np.float32)
        if probs is not None and len(probs):
            self.prob_last[keys] = np.asarray(probs, np.float32).reshape(-1)
        seen_before = self.last_use[keys] > NEVER
        gaps = (self.t - self.last_use[keys]).astype(np.float32)
        again = keys[seen_before]
        self.last_gap[again] = gaps[seen_before]
        first = self.mean_gap[again] >= 2.0 ** LOG_CAP
        self.mean_gap[again] = np.where(first, gaps[seen_before],
                                        0.75 * self.mean_gap[again] + 0.25 * gaps[seen_before])
        self.last_gap_feature[again] = _log_feature(self.last_gap[again])
        self.mean_gap_feature[again] = _log_feature(self.mean_gap[again])
        self.last_use[keys] = self.t
        row, ctx = self.row, self.ctx
        self.token_uses[row, keys] += 1
        self.token_seen[row] += 1
        self.context_uses[ctx, keys] += 1
        self.context_seen[ctx] += 1
        if self.rows_history:  # this token's routing followed the previous input tokens
            before = self.rows_history[-1]
            self.next_uses[before, keys] += 1
            self.next_seen[before] += 1
            for before in self.rows_history[-4:]:
                self.next4_uses[before, keys] += 0.25
                self.next4_seen[before] += 0.25
        self.rows_history = (self.rows_history + [row])[-4:]
        if self.prev_experts is not None and self.position > 0:
            # A layer's top-k experts are distinct, so no (layer, src, dst) pair repeats and
            # a plain indexed += counts each once (np.add.at is several times slower).
            pairs = (self.L, K, K)  # every (expert at t-1, expert at t) of a layer
            src = np.broadcast_to(self.prev_experts[:, :, None], pairs).reshape(-1)
            dst = np.broadcast_to(experts[:, None, :], pairs).reshape(-1)
            self.transition_counts[self._pair_layer, src, dst] += 1.0
            self.transition_sources[self._src_layer, self.prev_experts.reshape(-1)] += 1.0
        self.prev_experts = experts
        self.t += 1

    def raw_vectors(self, X: np.ndarray) -> np.ndarray:
        """The per-layer raw vectors (L, E * len(RAW)) of a feature matrix."""
        columns = [FEATURES.index(name) for name in RAW]
        return X[:, columns].reshape(self.L, self.E * len(RAW))


class OnlinePCA:
    """Principal components of the per-layer raw vectors, learned online: an exponentially
    weighted covariance (``decay`` per update), eigendecomposed after 50 updates and every
    ``every`` updates; each new basis is rotated onto the previous one (orthogonal
    Procrustes) so that what the predictor sees changes smoothly. ``components=0`` keeps the
    centred raw vector."""

    def __init__(self, dim: int, components: int, every: int = 250,
                 decay: float = 0.998) -> None:
        components = min(components, dim)  # a small model's raw vector may be shorter
        self.dim, self.k, self.every, self.decay = dim, components, every, decay
        self.mean = np.zeros(dim)
        self.cov = np.zeros((dim, dim))
        self.n = 0
        self.weight = 0.0
        self.basis = np.eye(dim, dtype=np.float32)[:components] if components else None
        self.variance_kept = float("nan")

    @property
    def out_dim(self) -> int:
        return self.k or self.dim

    # The covariance is C <- (1 - a) C + (a / m) X^T X per update (X: the m centred vectors).
    # Its products are deferred: each update keeps its X scaled by sqrt(a / m / s), s the
    # product of the (1 - a) since the last fold, and reading ``cov`` sums them all in one
    # matrix product, C = s (C_fold + sum X'^T X'), when a refit or a checkpoint needs it
    # (one 256 x 256 product per update cost a live extractor more than its features).

    @property
    def cov(self) -> np.ndarray:
        if self._pending:  # (s only changes when a product is deferred)
            scaled = np.concatenate(self._pending)
            self._cov += scaled.T @ scaled
            self._cov *= self._shrink
            self._pending, self._shrink = [], 1.0
        return self._cov

    @cov.setter
    def cov(self, value: np.ndarray) -> None:
        self._cov = value
        self._pending: list[np.ndarray] = []
        self._shrink = 1.0

    def update(self, vectors: np.ndarray) -> None:
        """One token's vectors (L, dim)."""
        self.weight = self.decay * self.weight + 1.0
        a = 1.0 / self.weight
        self.mean = (1 - a) * self.mean + a * vectors.mean(0)
        centred = vectors - self.mean
        if a > 0.5:  # the first updates: s would underflow to 0, so fold and apply now
            cov = self.cov
            cov *= 1 - a
            cov += (a / len(vectors)) * (centred.T @ centred)
        else:
            self._shrink *= 1 - a
            self._pending.append(centred * np.sqrt(a / len(vectors) / self._shrink))
        self.n += 1
        if self.k and (self.n == 50 or self.n % self.every == 0):
            self.refit()

    def refit(self) -> None:
        values, vectors = np.linalg.eigh(self.cov)
        values, vectors = values[::-1], vectors[:, ::-1]
        self.variance_kept = float(values[:self.k].sum() / max(values.sum(), 1e-12))
        basis = vectors[:, :self.k].T
        if self.n > 50:
            u, _, wt = np.linalg.svd(self.basis @ basis.T)
            basis = (u @ wt) @ basis
        self.basis = basis.astype(np.float32)

    def project(self, vectors: np.ndarray) -> np.ndarray:
        centred = (vectors - self.mean).astype(np.float32)
        return centred @ self.basis.T if self.k else centred

    def state(self) -> dict[str, np.ndarray]:
        return {"mean": self.mean, "cov": self.cov,
                "basis": self.basis if self.basis is not None else np.zeros(0, np.float32),
                "counters": np.array([self.n, self.weight, self.variance_kept])}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        self.mean, self.cov = state["mean"], state["cov"]
        if self.k:
            self.basis = state["basis"].astype(np.float32)
        n, self.weight, self.variance_kept = state["counters"].tolist()
        self.n = int(n)


PCA_EVERY_TOKENS = 4  # the covariance takes one token's vectors in this many


class ExtractorCore:
    """The extractor as the access stream drives it: one ``AccessEvent`` (token t's routing,
    its input token and the token it produced) in, the features of token t + 1 out."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, pca_components: int = 128,
                 params: ExtractorParams = ExtractorParams()) -> None:
        self.features = FeatureExtractor(num_layers, num_experts, top_k, params)
        self.pca = OnlinePCA(num_experts * len(RAW), pca_components)
        self._expect: tuple[int, int] | None = None  # (sequence, position) stepped last

    def on_event(self, sequence: int, position: int, input_token: str, next_token: str,
                 experts, probs) -> tuple[np.ndarray, np.ndarray] | None:
        """Record token t; returns (X, z) for token t + 1: per-expert features (N, F) and the
        reduced per-layer vectors (L, dims); None at the end of a sequence. An event whose
        routing or probabilities do not fit the model raises ``Dropped`` (checks.py) before
        anything changes."""
        fx = self.features
        experts = check_routing(experts, fx.L, fx.E, fx.K)
        probs = check_probs(probs, fx.L, fx.K)
        if self._expect != (sequence, position):  # a new sequence, or events were lost
            fx.step(input_token, position)
        fx.observe(experts, probs)
        if not next_token:
            self._expect = None
            return None
        X = fx.step(next_token, position + 1)
        self._expect = (sequence, position + 1)
        raw = fx.raw_vectors(X)
        z = self.pca.project(raw)
        if fx.t % PCA_EVERY_TOKENS == 0:
            self.pca.update(raw)
        return X, z


# --- checkpoints (safetensors + JSON; no pickle) ------------------------------------------------

# A checkpoint's array names ("fx.<name>") -> the extractor's attributes. The names on disk
# are the checkpoint format's (the cluster's payload carries none of them).
CHECKPOINT_NAMES = {
    "u1": "used_last", "u2": "used_before_last", "pr1": "prob_last", "last": "last_use",
    "gap": "last_gap", "gapm": "mean_gap", "tab_c": "token_uses", "tab_n": "token_seen",
    "nxt_c": "next_uses", "nxt_n": "next_seen", "nx4_c": "next4_uses", "nx4_n": "next4_seen",
    "ctx_c": "context_uses", "ctx_n": "context_seen", "tr_c": "transition_counts",
    "tr_n": "transition_sources", "ema2": "recent_freq", "ema8": "medium_freq",
    "ema64": "long_run_freq"}


def extractor_state(core: ExtractorCore) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, JSON-able meta) of an extractor: what it learned, not where a stream is. The
    token tables' rows go out in row order (``token_rows``: the token of each)."""
    fx = core.features
    rows = len(fx.token_row)
    tokens = [""] * rows
    for token, row in fx.token_row.items():
        tokens[row] = token
    arrays = {}
    for stored, name in CHECKPOINT_NAMES.items():
        value = getattr(fx, name)
        arrays[f"fx.{stored}"] = value[:rows] if name in ROW_TABLES else value
    arrays.update({f"pca.{k}": v for k, v in core.pca.state().items()})
    meta = {"L": fx.L, "E": fx.E, "K": fx.K, "tokens": fx.t, "params": fx.params.__dict__,
            "token_rows": tokens, "pca_components": core.pca.k}
    return arrays, meta


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_state(core: ExtractorCore, arrays: dict[str, np.ndarray], meta) -> int:
    """The number of token rows of a decoded checkpoint that fits ``core``; CheckpointMismatch
    for another model's (layers, experts, components), CheckpointDamaged for anything that
    is not what ``extractor_state`` writes."""
    if not isinstance(meta, dict) or not all(_is_count(meta.get(k)) for k in
                                             ("L", "E", "tokens", "pca_components")):
        raise CheckpointDamaged(f"unreadable meta {str(meta)[:200]}")
    fx = core.features
    if (meta["L"], meta["E"]) != (fx.L, fx.E) or meta["pca_components"] != core.pca.k:
        raise CheckpointMismatch(f"an extractor checkpoint of {meta['L']} layers x {meta['E']} "
                                 f"experts and {meta['pca_components']} components does not "
                                 f"fit {fx.L} x {fx.E} and {core.pca.k}")
    tokens = meta.get("token_rows")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens) or \
            len(set(tokens)) != len(tokens):
        raise CheckpointDamaged("token_rows is not a list of distinct tokens")
    expected = {f"fx.{stored}": getattr(fx, name)[:0] if name in ROW_TABLES
                else getattr(fx, name) for stored, name in CHECKPOINT_NAMES.items()}
    expected.update({f"pca.{k}": np.asarray(v) for k, v in core.pca.state().items()})
    if set(arrays) != set(expected):
        raise CheckpointDamaged(f"arrays {sorted(arrays)[:40]}, expected {sorted(expected)}")
    for name, mine in expected.items():
        value = arrays[name]
        per_token = name.startswith("fx.") and CHECKPOINT_NAMES[name[3:]] in ROW_TABLES
        shape = (len(tokens),) + mine.shape[1:] if per_token else mine.shape
        if value.dtype != mine.dtype or value.shape != shape:
            raise CheckpointDamaged(f"{name} is {value.dtype}{list(value.shape)}, expected "
                                    f"{mine.dtype}{list(shape)}")
        finite = np.isfinite(value[:2] if name == "pca.counters" else value)
        if value.dtype.kind == "f" and not finite.all():
            raise CheckpointDamaged(f"{name} has non-finite values")
    return len(tokens)


def load_extractor_state(core: ExtractorCore, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """Checked first (``_check_state``): ``core`` is left as it was when this raises."""
    rows = _check_state(core, arrays, meta)
    fx = core.features
    keep = min(rows, fx.params.max_token_rows)  # the first rows, when the cap is smaller
    fx.token_row = OrderedDict((token, i) for i, token in enumerate(meta["token_rows"][:keep]))
    for stored, name in CHECKPOINT_NAMES.items():
        value = arrays[f"fx.{stored}"].copy()
        if name in ROW_TABLES:
            size = min(max(1024, 2 * keep), fx.params.max_token_rows)
            grown = np.zeros((max(size, keep),) + value.shape[1:], value.dtype)
            grown[:keep] = value[:keep]
            value = grown
        setattr(fx, name, value)
    fx.last_gap_feature = _log_feature(fx.last_gap)
    fx.mean_gap_feature = _log_feature(fx.mean_gap)
    fx.t = int(meta["tokens"])
    core.pca.load_state({k[4:]: v for k, v in arrays.items() if k.startswith("pca.")})


CHECKPOINT_FILES = ("extractor.safetensors", "extractor.json")


def save_checkpoint(core: ExtractorCore, folder: str | Path) -> None:
    """``extractor.safetensors`` + ``extractor.json`` in ``folder``, each replaced durably
    (common/checkpoints.py: OSError, e.g. a full disk, leaves the previous ones). The
    safetensors file carries the JSON too, so that its arrays and their meta always come from
    the same save."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays, meta = extractor_state(core)
    text = json.dumps(meta)
    write_durably(folder / "extractor.safetensors", lambda tmp: save_file(
        {k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp),
        metadata={"extractor": text}))
    write_text_durably(folder / "extractor.json", text)


def load_checkpoint(core: ExtractorCore, folder: str | Path) -> dict:
    """Load what ``save_checkpoint`` wrote; returns its JSON. FileNotFoundError when it is
    missing, CheckpointMismatch when it is another model's, CheckpointDamaged when it cannot
    be decoded (zero-length, truncated, garbage, wrong arrays); ``core`` unchanged then."""
    meta, arrays = read_checkpoint(folder, "extractor", "numpy")
    load_extractor_state(core, arrays, meta)
    return meta
