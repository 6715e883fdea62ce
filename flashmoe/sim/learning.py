"""The learning path in-process: the feature extractor's and the predictor's own cores, fed
a routing trace in stream order, for `flashmoe bench` (on its virtual clock) and
`flashmoe warmup` (pre-training on a split).

Timing on the virtual clock (``LearningPath``): token t's access event is processed when its
last layer has run; the estimate for token t + 1 it yields is published on the predictor's
cadence (every ``publish_interval_ms`` of simulated time, the newest one), so the cache
manager only ever uses estimates made from the past, and ``stale_tokens`` delays them further
(the prediction-age study). The CPU time of extraction, inference and training is measured
per token, as the calling thread's CPU time (``time.thread_time``: the learning path runs on
one thread, and in the live processes the bus's own threads are not learning work).

A warm-up checkpoint is a folder: ``extractor.safetensors`` + ``extractor.json`` (the
extractor's tables and PCA) and ``predictor.safetensors`` + ``predictor.json``.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.cluster import ModelShape
from common.config import FlashMoEConfig
from common.threads import prepare_learning_path
from common.traces import TokenStream, Trace
from flashmoe.errors import CheckpointError
from flashmoe.sim.hooks import SIM_WORKER, ReplayHooks
from services.cache_manager.core import CacheManagerCore
from services.feature_extractor import sharing as extractor_sharing
from services.feature_extractor.core import (FEATURES, ExtractorCore, load_checkpoint,
                                             save_checkpoint)
from services.predictor import sharing as predictor_sharing
from services.predictor.core import Learner


@dataclass
class Learning:
    """The extractor and predictor cores of one stream, and their CPU time."""
    extractor: ExtractorCore
    learner: Learner
    cpu_s: dict = field(default_factory=lambda: {"extract": 0.0, "predict": 0.0})
    tokens: int = 0
    _pending: bool = False  # a prediction awaits its token's routing

    @classmethod
    def create(cls, num_layers: int, num_experts: int, top_k: int,
               config: FlashMoEConfig) -> "Learning":
        prepare_learning_path()  # one thread, a kept heap (common/threads.py)
        extractor = ExtractorCore(num_layers, num_experts, top_k,
                                  config.features.pca_components)
        learner = Learner(num_layers, num_experts, extractor.pca.out_dim, len(FEATURES),
                          config.predictor)
        return cls(extractor, learner)

    def on_token(self, stream: TokenStream, trace: Trace, t: int) -> np.ndarray | None:
        """Token t ran: returns the estimate S for token t + 1 (None at a sequence's end)."""
        started = time.thread_time()
        experts = trace.experts[t]
        probs = trace.probs[t] if trace.probs is not None else None
        out = self.extractor.on_event(int(stream.sequence[t]), int(stream.position[t]),
                                      stream.input_token[t], stream.next_token[t], experts,
                                      probs)
        middle = time.thread_time()
        self.cpu_s["extract"] += middle - started
        L, E = experts.shape[0], self.learner.E
        if self._pending:
            keys = (experts.astype(np.int64) + (np.arange(L) * E)[:, None]).reshape(-1)
            self.learner.observe(keys)
        S = None
        self._pending = out is not None
        if out is not None:
            X, z = out
            # As on the wire (FeatureBatch): per-expert features in float16.
            S = self.learner.predict(X.astype(np.float16).astype(np.float32), z)
        self.cpu_s["predict"] += time.thread_time() - middle
        self.tokens += 1
        return S

    def cpu_ms_per_token(self) -> float:
        return 1e3 * sum(self.cpu_s.values()) / max(self.tokens, 1)

    def reset_cpu(self) -> None:
        """Start the CPU accounting (this path's and the learner's stages) from zero."""
        self.cpu_s = dict.fromkeys(self.cpu_s, 0.0)
        self.learner.cpu_s = dict.fromkeys(self.learner.cpu_s, 0.0)
        self.tokens = 0

    # --- checkpoints ------------------------------------------------------------------------

    def save(self, folder: str | Path, extra: dict | None = None) -> None:
        save_checkpoint(self.extractor, folder)
        self.learner.save(folder, extra)

    def load(self, folder: str | Path) -> dict:
        try:
            load_checkpoint(self.extractor, folder)
            return self.learner.load(folder)
        except FileNotFoundError as exc:
            raise CheckpointError(f"{folder}: not a warm-up checkpoint ({exc.filename} is "
                                  f"missing); make one with `flashmoe warmup`") from None
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{folder}: unusable warm-up checkpoint: {exc}") from None


def cluster_shape(num_layers: int, num_experts: int, config: FlashMoEConfig) -> ModelShape:
    """What a peer's shared values must look like on this device (common/cluster.py): the
    extractor's arrays, and the predictor's for the inputs that extractor makes."""
    pca_components = config.features.pca_components
    arrays = extractor_sharing.shared_arrays(num_layers, num_experts, pca_components)
    dims, features = extractor_sharing.predictor_inputs(num_experts, pca_components)
    weights, meta = predictor_sharing.shared_arrays(num_layers, num_experts, dims, features,
                                                    config.predictor)
    return ModelShape({**arrays, **weights}, meta)


HOP_MS = 1.0  # the bus hops of one token's event and prediction, on top of the compute


class LearningPath(ReplayHooks):
    """The learning path on the replay's virtual clock, as the processes run it: the estimate
    for token t + 1 is ready when token t ends plus the CPU time the extractor and the
    predictor spent on it (measured) and the bus hops (``HOP_MS``); the predictor publishes a
    new estimate when at least ``publish_interval_ms`` passed since its last one, and the
    cache manager uses the latest, knowing which token it is for (the token's index is the
    step, as a live worker's AccessEvent seq is: a token's first layers run before its
    estimate arrives, on the one before, which the policy then reads as a past token's).
    ``stale_tokens`` hands out the estimate made that many tokens earlier (the prediction-age
    study). With ``prefetcher`` (the inline one) and ``learned`` (the look-ahead prefetch's
    count, margin, ratio and skip) it hints after each request as the cache manager does."""

    def __init__(self, trace: Trace, learning: Learning | None, publish_interval_ms: float,
                 stale_tokens: int = 0, prefetcher=None,
                 learned: tuple[int, float, float, int] | None = None,
                 inline_with_learned: bool = False) -> None:
        self.trace, self.learning = trace, learning
        self.stream = TokenStream.of(trace)
        self.interval = publish_interval_ms
        self.stale = stale_tokens
        self.made: deque = deque()  # estimates made, oldest first
        self.next_publish = 0.0
        self.published = 0
        self.prefetcher = prefetcher
        self.learned = learned  # the look-ahead prefetch's settings (core.learned_hints), or None
        self.inline_with_learned = inline_with_learned

    def start(self, core: CacheManagerCore) -> None:
        self.made.clear()
        if self.prefetcher is not None:
            self.prefetcher.reset()

    def before_request(self, core: CacheManagerCore, now_ms: float, token: int,
                       layer: int) -> None:
        if self.learning is None or now_ms < self.next_publish:
            return
        ready = 0
        while ready < len(self.made) and self.made[ready][0] <= now_ms:
            ready += 1
        if ready <= self.stale:
            return
        self.next_publish = now_ms + self.interval
        for _ in range(ready - self.stale - 1):
            self.made.popleft()
        _, S, step = self.made.popleft()
        core.set_estimate(S, step=step)
        self.published += 1

    def after_request(self, core: CacheManagerCore, now_ms: float, token: int, layer: int,
                      experts: list[int]) -> None:
        if self.prefetcher is not None:
            hint = core.inline_may_hint(self.learned[0] if self.learned else 0,
                                        self.inline_with_learned)
            self.prefetcher.after_request(core, SIM_WORKER, layer, experts,
                                          self.stream.input_token[token], hint=hint)
        if self.learned is not None:
            core.learned_hints(*self.learned)

    def after_token(self, token: int, now_ms: float) -> None:
        if self.learning is None:
            return
        cpu_before = sum(self.learning.cpu_s.values())
        S = self.learning.on_token(self.stream, self.trace, token)
        if S is not None:
            cpu_ms = 1e3 * (sum(self.learning.cpu_s.values()) - cpu_before)
            self.made.append((now_ms + cpu_ms + HOP_MS, S, token + 1))  # ready, S, its step
        else:
            self.made.clear()  # a sequence ended: nothing to say about a token not yet known


def warmup_fits(folder: str | Path, config: FlashMoEConfig,
                shape: tuple[int, int] | None = None) -> bool:
    """Whether ``folder`` holds a warm-up checkpoint made for this config's predictor (its
    network and size) and, given ``shape`` (layers, experts a layer), for that model's
    topology: a first-use warm-up made under another default is made again rather than
    rejected at load."""
    try:
        predictor = json.loads((Path(folder) / "predictor.json").read_text())
        extractor = json.loads((Path(folder) / "extractor.json").read_text())
        params, components = predictor["params"], extractor["pca_components"]
        shapes = {(predictor["L"], predictor["E"]), (extractor["L"], extractor["E"])}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return params.get("model") == config.predictor.model and \
        params.get("hidden") == config.predictor.lstm_hidden and \
        components == config.features.pca_components and \
        (shape is None or shapes == {tuple(shape)})


WARMUP_PASSES = 2  # two online passes over the warm-up split beat one on dev


def warmup(trace: Trace, config: FlashMoEConfig, out: str | Path, progress=None,
           passes: int = WARMUP_PASSES) -> dict:
    """Pre-train the extractor and the predictor on ``trace`` (stream order, as they learn
    live; ``passes`` times over it) and write the checkpoint; returns its summary."""
    learning = Learning.create(trace.num_layers, trace.num_experts, trace.top_k, config)
    stream = TokenStream.of(trace)
    started = time.perf_counter()
    for _ in range(passes):
        for t in range(trace.n_tokens):
            learning.on_token(stream, trace, t)
            if progress is not None:
                progress(1)
    learning.learner.set_anchor()
    summary = {"trace": trace.name, "tokens": trace.n_tokens, "passes": passes,
               "wall_s": round(time.perf_counter() - started, 1),
               "cpu_ms_per_token": round(learning.cpu_ms_per_token(), 3),
               "variance_kept": learning.extractor.pca.variance_kept,
               "drifts": len(learning.learner.drifts)}
    learning.save(out, {"warmup": summary})
    return summary
