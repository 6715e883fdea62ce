"""The predictor process: FeatureBatches in (SUB, from the feature extractor), Predictions
out (PUB, to the cache manager) every ``predictor.publish_interval_ms``.

One network step per token; the token's routing, carried by the next batch, is its label.
Training runs in this process, between batches, so the hot path never waits on it. The
weights are checkpointed (safetensors + JSON) into ``checkpoint_dir`` every
``predictor.checkpoint_every_s`` and at shutdown; a restarted predictor resumes from there
(else from the warm-up checkpoint, else cold; common/checkpoints.py: a damaged checkpoint of
its own is moved aside, a failed write such as a full disk is skipped with a warning and tried
again after ``checkpoint_every_s``). A batch whose values do not fit the model or the
session's first batch (its dims and features) is dropped and counted (``dropped_<reason>``;
core.check_batch). With ``cluster.redis_url``, a first start takes the weights of the peer
with the most tokens before the warm-up checkpoint (common/cluster.py; what it shares:
sharing.py), and a thread publishes this device's weights.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import zmq

from common.bus import Publisher, SeqGaps, Subscriber
from common.checkpoints import Throttle, arm_checkpoint_fault, resume
from common.checks import Dropped
from common.cluster import (
    ClusterAgent,
    ModelShape,
    cluster_stats,
    merge,
    open_link,
    predictor_values,
)
from common.config import FlashMoEConfig
from common.protocol import FeatureBatch, LearningMessage, Prediction
from common.service import Service, run_service_process
from common.store import ExpertStore
from common.threads import prepare_learning_path

from .core import (
    CHECKPOINT_FILES,
    Learner,
    check_batch,
    next_token_recall,
    prepare_learner,
)
from .sharing import learner_patterns, write_predictor_checkpoint


class PredictorService(Service):
    name = "predictor"

    def __init__(self, config: FlashMoEConfig, features: list[str], publish: str,
                 control_endpoint: str, checkpoint_dir: str, warmup: str | None = None,
                 cluster_shape: ModelShape | None = None) -> None:
        super().__init__(config, control_endpoint)
        manifest = ExpertStore.open(config.store.path).manifest
        self.layers, self.experts = len(manifest.moe_layers), manifest.num_experts
        self.top_k = manifest.top_k
        self.checkpoint_dir = Path(checkpoint_dir)
        arm_checkpoint_fault(self.log)
        self.disk_warning = Throttle(self.log)
        self.drop_warning = Throttle(self.log)
        self.learner: Learner | None = None  # made at the first batch (its feature shape)
        prepare_learner(config.predictor)
        self.warmup = warmup
        self.receive = Subscriber(self.ctx, config, features, LearningMessage, self.counters,
                                  "predictor")
        self.publisher = Publisher(self.ctx, config, publish)
        self.gaps = SeqGaps(self.counters)
        self.epoch = time.time_ns()
        self.seq = 0
        self.latest: tuple[np.ndarray, int] | None = None  # (S, event seq), not yet published
        self.pending = False  # a prediction awaits its token's routing
        self.recall_sum, self.recall_n = 0.0, 0  # recall@k of the next-token estimates
        self.last_publish = 0.0
        self.last_checkpoint = time.monotonic()
        self.resumed_from = ""
        self.cluster: ClusterAgent | None = None
        self.cluster_checkpoint: Path | None = None  # the chosen peer's weights, as a folder
        self.warm_start: dict | None = None
        if config.cluster.redis_url:
            self._join_cluster(manifest, cluster_shape)
        self.counters.update(batches=0, predictions=0, checkpoints=0, checkpoint_failures=0,
                             n_gap=0, n_out_of_order=0, rejected_unexpected=0)

    def _join_cluster(self, manifest, shape: ModelShape | None) -> None:
        """A first start (no checkpoint of its own) takes the weights of a peer whose values
        have this device's ``shape``; then the agent publishes this device's on its own
        thread."""
        if shape is None:
            raise ValueError("cluster.redis_url is set but the shapes of the peers' values "
                             "were not given (cluster_shape)")
        link = open_link(self.config, manifest)
        if not (self.checkpoint_dir / "predictor.json").is_file():
            warm = merge(link.fetch_peers(shape))
            if warm is not None:
                self.warm_start = warm.summary()
                try:
                    self.cluster_checkpoint = write_predictor_checkpoint(
                        warm, self.checkpoint_dir.with_name(self.checkpoint_dir.name +
                                                            ".cluster"))
                except OSError as exc:  # a full disk: start without the peer's weights
                    self.log.warning("cannot write the peer's weights: %s", exc)
        self.cluster = ClusterAgent(link, self._cluster_values, self.name)
        self.cluster.start()

    def _cluster_values(self) -> dict[str, bytes] | None:
        with self.lock:  # a float16 copy of the weights; encoding happens off the loop
            if self.learner is None:
                return None
            weights, meta = learner_patterns(self.learner)
        return predictor_values(self.cluster.link.device, meta["tokens"], weights, meta,
                                time.time_ns())

    def sockets(self) -> list[zmq.Socket]:
        return [self.receive.socket]

    def close_sockets(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.learner is not None:
            self.checkpoint()
        self.receive.close()
        self.publisher.close()

    def _make_learner(self, dims: int, features: int) -> Learner:
        """A learner resumed from the first of its checkpoint, the cluster's and the warm-up
        that fits (common/checkpoints.py), else cold."""
        learner = Learner(self.layers, self.experts, dims, features, self.config.predictor)
        self.resumed_from, _ = resume((self.checkpoint_dir, self.cluster_checkpoint,
                                       self.warmup), "predictor.json", learner.load, self.log,
                                      CHECKPOINT_FILES)
        return learner

    def on_readable(self, sock: zmq.Socket) -> None:
        for message in self.receive.drain(limit=64):  # then the lock is let go a moment
            if not isinstance(message, FeatureBatch):
                self.counters["rejected_unexpected"] += 1
                continue
            self.handle_batch(message)
        self.maybe_publish(time.monotonic())  # as soon as the interval allows, not on a tick

    def handle_batch(self, batch: FeatureBatch) -> None:
        self.counters["batches"] += 1
        missed = self.gaps.observe(batch.source, batch.seq, batch.epoch)
        try:
            z, x, routing = check_batch(batch, self.layers, self.experts, self.top_k,
                                        *((self.learner.dims, self.learner.features)
                                          if self.learner is not None else ()))
        except Dropped as exc:
            self.counters[f"dropped_{exc.reason}"] += 1
            self.drop_warning.warning("dropped a feature batch from %s: %s", batch.source, exc)
            return
        if self.learner is None:
            self.learner = self._make_learner(batch.dims, batch.features)
        if self.pending and not missed:
            if self.learner.last_p_used is not None:  # how the last estimate did
                self.recall_sum += next_token_recall(self.learner.last_p_used, routing)
                self.recall_n += 1
            keys = (routing + (np.arange(self.layers) * self.experts)[:, None]).reshape(-1)
            self.learner.observe(keys)
        S = self.learner.predict(x, z)
        self.pending = True
        self.latest = (S, batch.event_seq)

    def on_tick(self, now: float) -> None:
        self.maybe_publish(now)
        if self.learner is not None and \
                now - self.last_checkpoint >= self.config.predictor.checkpoint_every_s:
            self.checkpoint()

    def maybe_publish(self, now: float) -> None:
        """The newest estimate goes out once ``publish_interval_ms`` has passed since the
        last one."""
        interval = self.config.predictor.publish_interval_ms / 1000
        if self.latest is not None and now - self.last_publish >= interval:
            S, event_seq = self.latest
            self.publisher.publish(Prediction(self.name, self.epoch, self.seq, event_seq,
                                              self.learner.steps, self.layers, self.experts,
                                              S.shape[0], S.astype(np.float32).tobytes()))
            self.seq += 1
            self.counters["predictions"] += 1
            self.latest = None
            self.last_publish = now

    def checkpoint(self) -> None:
        """Save the learner; a failed write (a full disk) is skipped with a warning, the
        previous checkpoint kept, and tried again after ``checkpoint_every_s``."""
        self.last_checkpoint = time.monotonic()
        try:
            self.learner.save(self.checkpoint_dir)
        except OSError as exc:
            self.counters["checkpoint_failures"] += 1
            self.disk_warning.warning("checkpoint skipped, the previous one kept: %s", exc)
            return
        self.counters["checkpoints"] += 1

    def tune(self, changes: dict, check: bool) -> tuple[list[str], dict[str, str]]:
        """EWC weights and the drift detector, live (the learner reads its settings at each
        step; a learner not made yet takes them from self.config)."""
        live = ("predictor.ewc_strength", "predictor.ewc_lambda", "predictor.drift",
                "predictor.drift_threshold")
        applied = [key for key in changes if key in live]
        if not check and self.learner is not None and applied:
            import dataclasses

            from .core import DRIFT_DELTA, PageHinkley

            learner = self.learner
            learner.config = dataclasses.replace(
                learner.config, **{key.split(".", 1)[1]: changes[key] for key in applied})
            p = learner.config
            if not p.drift:
                learner.drift = None
            elif learner.drift is None:
                learner.drift = PageHinkley(DRIFT_DELTA, p.drift_threshold)
            else:
                learner.drift.threshold = p.drift_threshold
        return applied, {}

    def stats(self) -> dict:
        out = {**super().stats(), "resumed_from": self.resumed_from}
        if self.cluster is not None:
            out.update(cluster_stats(self.cluster.link, self.warm_start))
        if self.learner is not None:
            tokens = max(self.learner.t, 1)
            out.update(model=self.learner.config.model, inference=self.learner.inference,
                       tokens=self.learner.t,
                       steps=self.learner.steps, drifts=len(self.learner.drifts),

                       **{f"cpu_ms_{k}": round(1e3 * v / tokens, 3)
                          for k, v in self.learner.cpu_s.items()})
        if self.recall_n:  # once an estimate has met its token
            out["recall_at_k"] = round(self.recall_sum / self.recall_n, 4)
        return out


def run_predictor_process(config: FlashMoEConfig, features: list[str], publish: str,
                          control_endpoint: str, checkpoint_dir: str,
                          warmup: str | None = None,
                          cluster_shape: ModelShape | None = None) -> int:
    """``cluster_shape``: what the peers' shared values must look like (needed with
    ``cluster.redis_url``)."""
    prepare_learning_path()  # see common/threads.py
    return run_service_process(lambda: PredictorService(config, features, publish,
                                                        control_endpoint, checkpoint_dir,
                                                        warmup, cluster_shape),
                               PredictorService.name)
