"""The predictor's core: the online learner (no sockets, no clocks).

Per token: ``predict(x, z)`` steps the network on the token's features and returns the
eviction estimate S (VARIANTS, N) for it; ``observe(keys)`` then records which experts that
token used. Every ``train_every_tokens`` tokens it trains on the last ``window_tokens``
tokens (truncated backpropagation through time from the LSTM state stored at the window's
start); a label is the bucket of the distance to the expert's next use inside the window, or
"beyond the window's end" (censored: every bucket past it is allowed).

Against forgetting, EWC (elastic weight consolidation): a penalty ``ewc_strength`` x
sum F (theta - theta*)^2, F a running diagonal Fisher estimate (squared gradients, normalised
to mean 1), theta* the weights at the last anchor (the end of a warm-up, or of an elastic
update). A Page-Hinkley detector on the per-token loss of "used in this token" flags drift
(a task switch); it starts an elastic update: ``ELASTIC_TOKENS`` tokens at
``ELASTIC_LR_FACTOR`` times the learning rate, the EWC penalty weighted by ``ewc_lambda``
(x ``ewc_strength``), then a new anchor. (On the dev split EWC at any strength tried loses hit
rate: the new datasets are what the policy must adapt to; ``ewc_strength`` is 0 by default,
and a drift is then a learning-rate boost.) Inference can run on an INT8 dynamically
quantized copy (``int8``), refreshed after each training step.

The settings are the ``predictor`` section of the config (``PredictorConfig``); what the
learner fixes is named below. Checkpoints are safetensors (weights, optimiser-free) plus a
JSON of hyper-parameters and counters; never pickle.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import save_file

from common.checkpoints import (CheckpointDamaged, CheckpointMismatch, read_checkpoint,
                                write_durably,
                                write_text_durably)
from common.checks import Dropped, check_routing
from common.config import PredictorConfig

from . import fast_infer
from .model import Net, bucket_nll, bucket_of, estimates

CENSORED = 10 ** 9


# What the learner fixes (the tunable settings are common/config.py's PredictorConfig):
LSTM_LAYERS = 2  # layers of the LSTM (predictor.model = lstm)
FAST_LR_FACTOR = 5  # the per-key bias and the skip weights learn at this x learning_rate
HEAD_B_WEIGHT = 0.25  # weight of head B's loss beside head A's
FISHER_DECAY = 0.99  # per training step, of the running diagonal Fisher estimate
DRIFT_DELTA = 0.005  # Page-Hinkley tolerance (delta) of the drift detector
ELASTIC_TOKENS = 500  # tokens of an elastic update after a drift
ELASTIC_LR_FACTOR = 3.0  # the learning rate x this during an elastic update
SEED = 0  # torch's seed for the initial weights


def checkpoint_params(config: PredictorConfig) -> dict:
    """The hyper-parameters a checkpoint records (``predictor.json``'s ``params``), under the
    checkpoint format's names; ``model`` and ``hidden`` decide whether it fits a predictor."""
    return {"model": config.model, "hidden": config.lstm_hidden, "lstm_layers": LSTM_LAYERS,
            "window": config.window_tokens, "train_every": config.train_every_tokens,
            "lr": config.learning_rate, "lr_fast": FAST_LR_FACTOR * config.learning_rate,
            "weight_b": HEAD_B_WEIGHT, "ewc_strength": config.ewc_strength,
            "ewc_lambda": config.ewc_lambda, "fisher_decay": FISHER_DECAY,
            "drift": config.drift, "drift_delta": DRIFT_DELTA,
            "drift_threshold": config.drift_threshold, "elastic_tokens": ELASTIC_TOKENS,
            "elastic_lr": ELASTIC_LR_FACTOR, "int8": config.int8,
            "infer_precision": config.infer_precision, "seed": SEED}


class PageHinkley:
    """Page-Hinkley test for an upward shift of a stream's mean."""

    def __init__(self, delta: float, threshold: float) -> None:
        self.delta, self.threshold = delta, threshold
        self.reset()

    def reset(self) -> None:
        self.mean, self.n, self.cum, self.min = 0.0, 0, 0.0, 0.0

    def update(self, value: float) -> bool:
        self.n += 1
        self.mean += (value - self.mean) / self.n
        self.cum += value - self.mean - self.delta
        self.min = min(self.min, self.cum)
        if self.cum - self.min > self.threshold:
            self.reset()
            return True
        return False


def window_labels(used: np.ndarray, w: int) -> tuple[np.ndarray, ...]:
    """Labels of the first ``w`` of the ``len(used)`` last tokens (oldest first; ``used`` is
    (n, N) bool): for head A (the distance from step j) and head B (from j + 1, for experts
    used at j) the bucket and whether it is censored (no use seen yet: the next use lies
    beyond the window, the bucket is that of the window's end + 1 and the loss is -log
    P(bucket >= it)); and head B's weights (used at j, with anything known after j)."""
    n, N = used.shape
    nxt = np.full(N, CENSORED, np.int64)
    for j in range(n - 1, w - 1, -1):
        nxt[used[j]] = j
    dist_a = np.empty((w, N), np.int64)
    dist_b = np.empty((w, N), np.int64)
    for j in range(w - 1, -1, -1):
        dist_b[j] = nxt - j  # from j + 1 to the first use after j (1 = used at j + 1)
        nxt[used[j]] = j
        dist_a[j] = nxt - j + 1
    steps = np.arange(w)[:, None]
    cens_a = dist_a > CENSORED // 2
    bucket_a = bucket_of(np.where(cens_a, n - steps + 1, dist_a))
    cens_b = dist_b > CENSORED // 2
    end_b = n - 1 - steps  # head B's censoring point
    bucket_b = bucket_of(np.where(cens_b, end_b + 1, dist_b))
    weight_b = used[:w] & ~(cens_b & (end_b <= 0))
    return bucket_a, cens_a, bucket_b, cens_b, weight_b


def recall_at(top: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Per layer: |top ∩ actual| / k for (L, k) top and (L, k) actual."""
    return (top[:, :, None] == actual[:, None, :]).any(1).sum(1) / actual.shape[1]


def next_token_recall_per_layer(p_used: np.ndarray, routing: np.ndarray) -> np.ndarray:
    """recall@k per layer of the experts ``routing`` ((L, k)) used by the token that followed
    an estimate, against the k experts of each layer the estimate gave the highest chance of
    use (``p_used``, (L * E,))."""
    L, k = routing.shape
    top = np.argsort(-p_used.reshape(L, -1), axis=1)[:, :k]
    return recall_at(top, routing)


def next_token_recall(p_used: np.ndarray, routing: np.ndarray) -> float:
    """The same, over every layer."""
    return float(next_token_recall_per_layer(p_used, routing).mean())


def prepare_learner(config: PredictorConfig) -> None:
    """Pay now for what a process's first Learner loads on first use (its optimizer's lazy
    imports of torch, the fused inference library): about a second of CPU, which a service
    spends before it reports ready rather than at its first batch, beside the worker's
    compute."""
    Learner(1, 2, 1, 1, config)


class Learner:
    def __init__(self, num_layers: int, num_experts: int, dims: int, features: int,
                 config: PredictorConfig | None = None) -> None:
        self.L, self.E, self.N = num_layers, num_experts, num_layers * num_experts
        self.dims, self.features = dims, features
        self.config = config = config if config is not None else PredictorConfig()
        torch.manual_seed(SEED)
        self.net = Net(num_layers, num_experts, dims, features, config.model,
                       config.lstm_hidden, LSTM_LAYERS)
        self.opt = torch.optim.Adam([
            {"params": self.net.fast_parameters(),
             "lr": FAST_LR_FACTOR * config.learning_rate},
            {"params": self.net.slow_parameters(), "lr": config.learning_rate}], fused=True)
        self.base_lr = [group["lr"] for group in self.opt.param_groups]
        self.W = config.window_tokens
        self.zbuf = np.zeros((self.W, num_layers, dims), np.float32)
        self.xbuf = np.zeros((self.W, self.N, features), np.float32)
        self.used = np.zeros((self.W, self.N), bool)
        self.states: list = [None] * self.W  # LSTM state before each buffered step
        self.state = None
        self.t = 0  # tokens observed
        self.steps = 0  # training steps taken (the model version)
        self.infer_net: nn.Module = self.net
        self.fisher_raw: list[torch.Tensor] | None = None
        self.fisher: list[torch.Tensor] | None = None
        self.anchor: list[torch.Tensor] | None = None
        self.drift = PageHinkley(DRIFT_DELTA, config.drift_threshold) if config.drift else None
        self.elastic_until = -1
        self.drifts: list[int] = []
        self.last_p_used: np.ndarray | None = None
        # CPU seconds per stage, of the calling thread (the learning path runs on one).
        self.cpu_s = {"infer": 0.0, "train": 0.0, "quantize": 0.0}
        self.losses: list[float] = []
        self.fused: fast_infer.FusedInference | None = None
        try:
            self.fused = fast_infer.FusedInference(self.net, config.infer_precision)
            self.inference = f"fused C, {config.infer_precision} heads"
        except RuntimeError as exc:  # the library is not built: the numpy path
            self.inference = f"numpy, fp32 ({exc})"

    # --- inference ----------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, x: np.ndarray, z: np.ndarray) -> np.ndarray:
        """Features of the coming token: x (N, features), z (L, dims) -> S (VARIANTS, N)."""
        started = time.thread_time()
        i = self.t % self.W
        self.zbuf[i], self.xbuf[i], self.states[i] = z, x, self.state
        if self.infer_net is self.net and self.fused is not None:
            h, self.state = self.net.recurrent_step(self.zbuf[i], self.state)
            S, self.last_p_used = self.fused(h, self.xbuf[i])
        else:
            if self.infer_net is self.net:
                logits, self.state = self.net.step(self.zbuf[i], self.xbuf[i], self.state)
                logits = torch.from_numpy(logits)
            else:  # the INT8 copy: its quantized LSTM runs as a module
                logits, self.state = self.infer_net(torch.from_numpy(self.zbuf[i:i + 1]),
                                                    torch.from_numpy(self.xbuf[i:i + 1]),
                                                    self.state)
                logits = logits[0]
            P = torch.softmax(logits, 1).numpy()  # (HEADS, BUCKETS, N)
            self.last_p_used = P[0, 0]
            S = estimates(P, self.L)
        self.cpu_s["infer"] += time.thread_time() - started
        return S

    # --- learning -----------------------------------------------------------------------------

    def observe(self, keys: np.ndarray) -> None:
        """The keys the predicted token used; trains every ``train_every`` tokens."""
        i = self.t % self.W
        self.used[i] = False
        self.used[i, keys] = True
        if self.drift is not None and self.last_p_used is not None:
            p = np.clip(self.last_p_used, 1e-4, 1 - 1e-4)
            loss = -float(np.mean(np.where(self.used[i], np.log(p), np.log(1 - p))))
            if self.drift.update(loss) and self.t > self.elastic_until:
                self.drifts.append(self.t)
                self.elastic_until = self.t + ELASTIC_TOKENS
        self.t += 1
        if self.t % self.config.train_every_tokens == 0 and self.t >= 2:
            started = time.thread_time()
            self.train_step()
            self.cpu_s["train"] += time.thread_time() - started
            started = time.thread_time()
            self.refresh_inference()
            self.cpu_s["quantize"] += time.thread_time() - started
        if self.t == self.elastic_until:
            self.set_anchor()

    def train_step(self) -> None:
        n = min(self.W, self.t)
        idx = [(self.t - n + j) % self.W for j in range(n)]
        bucket_a, cens_a, bucket_b, cens_b, weight_b = window_labels(self.used[idx], n)
        z = torch.from_numpy(self.zbuf[idx])
        x = torch.from_numpy(self.xbuf[idx])
        logits, _ = self.net(z, x, self.states[idx[0]])
        nll = bucket_nll(logits, torch.from_numpy(np.stack([bucket_a, bucket_b], 1)),
                         torch.from_numpy(np.stack([cens_a, cens_b], 1)))  # (n, HEADS, N)
        wb = torch.from_numpy(weight_b).float()
        loss = nll[:, 0].mean() + (nll[:, 1] * wb).sum() / wb.sum().clamp(min=1) \
            * HEAD_B_WEIGHT
        self.losses.append(float(nll[:, 0].mean().detach()))
        elastic = self.t < self.elastic_until
        weight = self.config.ewc_strength * (self.config.ewc_lambda if elastic else 1.0)
        if self.anchor is not None and weight:
            penalty = sum((f * (q - a) ** 2).sum() for q, f, a in
                          zip(self.net.parameters(), self.fisher, self.anchor))
            loss = loss + weight * penalty
        self.opt.zero_grad()
        loss.backward()
        if self.config.ewc_strength:
            self._update_fisher()
        scale = ELASTIC_LR_FACTOR if elastic else 1.0
        for group, lr in zip(self.opt.param_groups, self.base_lr):
            group["lr"] = lr * scale
        self.opt.step()
        self.steps += 1

    def _update_fisher(self) -> None:
        d = FISHER_DECAY
        if self.fisher_raw is None:
            self.fisher_raw = [torch.zeros_like(p) for p in self.net.parameters()]
        for f, p in zip(self.fisher_raw, self.net.parameters()):
            if p.grad is not None:
                f.mul_(d).add_((1 - d) * p.grad.detach() ** 2)

    def set_anchor(self) -> None:
        """EWC anchor: theta* = the current weights, F = the Fisher estimate / its mean."""
        if self.fisher_raw is None:
            return
        total = sum(float(f.sum()) for f in self.fisher_raw)
        count = sum(f.numel() for f in self.fisher_raw)
        mean = max(total / count, 1e-20)
        self.fisher = [f / mean for f in self.fisher_raw]
        self.anchor = [p.detach().clone() for p in self.net.parameters()]

    def refresh_inference(self) -> None:
        """The inference copy after the weights changed: the INT8 network where that is what
        runs (``int8``), else the fused path's low-precision heads."""
        if self.config.int8:
            self.quantize()
        elif self.fused is not None:
            self.fused.refresh()

    def quantize(self) -> None:
        self.infer_net = torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(self.net), {nn.LSTM, nn.Linear}, dtype=torch.qint8)

    # --- checkpoints --------------------------------------------------------------------------

    def save(self, folder: str | Path, extra: dict | None = None) -> None:
        """Weights (and the EWC anchor and Fisher) as safetensors, the rest as JSON, each
        replaced durably (common/checkpoints.py: OSError, e.g. a full disk, leaves the previous
        ones). The safetensors file carries the JSON too, so that weights and meta always come
        from the same save."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"net.{k}": v.detach().contiguous() for k, v in self.net.state_dict().items()}
        if self.anchor is not None:
            names = [n for n, _ in self.net.named_parameters()]
            tensors.update({f"anchor.{n}": a.contiguous() for n, a in zip(names, self.anchor)})
            tensors.update({f"fisher.{n}": f.contiguous() for n, f in zip(names, self.fisher)})
        meta = {"params": checkpoint_params(self.config), "L": self.L, "E": self.E,
                "dims": self.dims, "features": self.features, "tokens": self.t, "steps": self.steps,
                "drifts": len(self.drifts), **(extra or {})}
        text = json.dumps(meta, indent=1)
        write_durably(folder / "predictor.safetensors",
                      lambda tmp: save_file(tensors, str(tmp), metadata={"predictor": text}))
        write_text_durably(folder / "predictor.json", text)

    def load(self, folder: str | Path) -> dict:
        """Weights from a checkpoint of the same shape; returns its JSON. FileNotFoundError
        when it is missing, CheckpointMismatch for another shape or network,
        CheckpointDamaged when it cannot be decoded (zero-length, truncated, garbage, wrong or
        non-finite tensors); the learner is unchanged then."""
        folder = Path(folder)
        path = folder / "predictor.safetensors"
        meta, tensors = read_checkpoint(folder, "predictor", "pt")
        try:
            shape = (meta["L"], meta["E"], meta["dims"], meta["features"])
            network = (meta["params"]["model"], meta["params"]["hidden"])
            steps = meta.get("steps", 0)
        except Exception as exc:  # JSON of another kind: not a checkpoint
            raise CheckpointDamaged(f"{path}: {type(exc).__name__}: {exc}") from None
        if shape != (self.L, self.E, self.dims, self.features):
            raise CheckpointMismatch(f"{folder}: checkpoint of shape (layers, experts, dims, "
                                     f"features) {shape}, this predictor is "
                                     f"{(self.L, self.E, self.dims, self.features)}")
        if network != (self.config.model, self.config.lstm_hidden):
            raise CheckpointMismatch(f"{folder}: checkpoint of a {network[0]} model with hidden "
                                     f"{network[1]}, this predictor is {self.config.model} "
                                     f"with hidden {self.config.lstm_hidden}")
        names = [n for n, _ in self.net.named_parameters()]
        expected = {f"net.{k}": v for k, v in self.net.state_dict().items()}
        if f"anchor.{names[0]}" in tensors:
            params = dict(self.net.named_parameters())
            for n in names:
                expected[f"anchor.{n}"] = expected[f"fisher.{n}"] = params[n]
        if set(tensors) != set(expected):
            raise CheckpointDamaged(f"{path}: tensors {sorted(tensors)[:20]}, expected "
                                    f"{sorted(expected)[:20]}")
        for key, mine in expected.items():
            value = tensors[key]
            if value.dtype != mine.dtype or value.shape != mine.shape or \
                    (value.is_floating_point() and not torch.isfinite(value).all()):
                raise CheckpointDamaged(f"{path}: {key} is {value.dtype}{list(value.shape)}, "
                                        f"expected finite {mine.dtype}{list(mine.shape)}")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise CheckpointDamaged(f"{path}: steps {steps!r}")
        self.net.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("net.")})
        if f"anchor.{names[0]}" in tensors:
            self.anchor = [tensors[f"anchor.{n}"] for n in names]
            self.fisher = [tensors[f"fisher.{n}"] for n in names]
            self.fisher_raw = [f.clone() for f in self.fisher]
        self.steps = steps
        self.infer_net = self.net
        self.refresh_inference()
        return meta


CHECKPOINT_FILES = ("predictor.safetensors", "predictor.json")


def check_batch(batch, layers: int, experts: int, top_k: int, dims: int | None = None,
                features: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z (layers, dims) float32, x (layers * experts, features) float32, routing (layers,
    top_k) int64) of a FeatureBatch checked against the model and the session's shape
    (``dims``, ``features``: those of the session's first batch; None before it). ``Dropped``
    with ``layers``, ``experts_per_layer``, ``dims``, ``features``, ``buffer``, ``nonfinite``
    or one of ``check_routing``'s reasons (``layers``, ``top_k``, ``expert_range``,
    ``duplicate_expert``)."""
    if batch.layers != layers:
        raise Dropped("layers", f"a batch of {batch.layers} layers, the model has {layers}")
    if batch.experts_per_layer != experts:
        raise Dropped("experts_per_layer", f"a batch of {batch.experts_per_layer} experts a "
                                           f"layer, the model has {experts}")
    if batch.dims != (dims or batch.dims) or batch.dims < 1:
        raise Dropped("dims", f"a batch of {batch.dims} dims, the session's are {dims}")
    if batch.features != (features or batch.features) or batch.features < 1:
        raise Dropped("features", f"a batch of {batch.features} features, the session's are "
                                  f"{features}")
    dims, features = batch.dims, batch.features
    if len(batch.per_layer) != 4 * layers * dims or \
            len(batch.per_expert) != 2 * layers * experts * features:
        raise Dropped("buffer", f"buffers of {len(batch.per_layer)} and "
                                f"{len(batch.per_expert)} bytes, expected {4 * layers * dims} "
                                f"and {2 * layers * experts * features}")
    routing = check_routing(batch.experts, layers, experts, top_k)
    z = np.frombuffer(batch.per_layer, np.float32).reshape(layers, dims).copy()
    x = np.frombuffer(batch.per_expert, np.float16).reshape(layers * experts, features)
    if not (np.isfinite(z).all() and np.isfinite(x).all()):
        raise Dropped("nonfinite", "NaN or infinite features")
    return z, x.astype(np.float32), routing
