"""The feature extractor process: AccessEvents in (SUB, from the workers), FeatureBatches out
(PUB, to the predictor), one per token, sequence-numbered.

Every event is counted by its source's sequence numbers (lost ones in ``n_gap``); a malformed
or wrong-version message is counted and dropped, and so is a well-formed one whose values do
not fit the store's model (``dropped_<reason>``, checks.py; logged at a bounded rate). With a
``checkpoint_dir`` the core's tables are checkpointed there every
``predictor.checkpoint_every_s`` (when they changed) and at a clean shutdown, and a restart
resumes from there; else, or when that checkpoint does not fit the store's model, they start
from a warm-up checkpoint (``--warmup``) that fits, else cold (common/checkpoints.py: a damaged
checkpoint of its own is moved aside; a failed write, e.g. a full disk, is skipped with a
warning and tried again after ``checkpoint_every_s``). With ``cluster.redis_url`` they also
start from the peers' shared popularity, transitions and PCA (common/cluster.py; what it
shares: sharing.py), and a thread publishes this device's.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import zmq

from common.bus import Publisher, SeqGaps, Subscriber
from common.checkpoints import Throttle, arm_checkpoint_fault, resume
from common.cluster import (
    ClusterAgent,
    ModelShape,
    cluster_stats,
    extractor_values,
    merge,
    open_link,
)
from common.config import FlashMoEConfig
from common.protocol import AccessEvent, FeatureBatch, LearningMessage
from common.service import Service, run_service_process
from common.store import ExpertStore
from common.threads import prepare_learning_path

from common.checks import Dropped
from .core import CHECKPOINT_FILES, FEATURES, ExtractorCore, load_checkpoint, save_checkpoint
from .sharing import apply_to_extractor, extractor_patterns


class FeatureExtractorService(Service):
    name = "feature_extractor"

    def __init__(self, config: FlashMoEConfig, events: list[str], publish: str,
                 control_endpoint: str, warmup: str | None = None,
                 cluster_shape: ModelShape | None = None,
                 checkpoint_dir: str | None = None) -> None:
        super().__init__(config, control_endpoint)
        manifest = ExpertStore.open(config.store.path).manifest
        self.layers = len(manifest.moe_layers)
        self.shape = (self.layers, manifest.num_experts, manifest.top_k,
                      config.features.pca_components)
        self.core = ExtractorCore(*self.shape)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        arm_checkpoint_fault(self.log)
        self.disk_warning = Throttle(self.log)
        self.drop_warning = Throttle(self.log)
        self.resumed_from, _ = resume((self.checkpoint_dir, warmup), "extractor.json",
                                      self._load, self.log, CHECKPOINT_FILES)
        self.saved_tokens = self.core.features.t  # what the checkpoint folder already holds
        self.last_checkpoint = time.monotonic()
        self.cluster: ClusterAgent | None = None
        self.warm_start: dict | None = None
        if config.cluster.redis_url:
            self._join_cluster(manifest, cluster_shape)
        self.receive = Subscriber(self.ctx, config, events, LearningMessage, self.counters,
                                  "feature extractor")
        self.publisher = Publisher(self.ctx, config, publish)
        self.gaps = SeqGaps(self.counters)
        self.epoch = time.time_ns()
        self.seq = 0
        self.cpu_s = 0.0
        self.counters.update(events=0, batches=0, checkpoints=0, checkpoint_failures=0, n_gap=0,
                             n_out_of_order=0, rejected_unexpected=0)

    def _load(self, folder: str) -> dict:
        """Tables from ``folder`` into a fresh core, kept only when they fit."""
        core = ExtractorCore(*self.shape)
        meta = load_checkpoint(core, folder)
        self.core = core
        return meta

    def checkpoint(self) -> None:
        """Save the tables; a failed write (a full disk) is skipped with a warning, the
        previous checkpoint kept, and tried again after ``checkpoint_every_s``."""
        self.last_checkpoint = time.monotonic()
        try:
            save_checkpoint(self.core, self.checkpoint_dir)
        except OSError as exc:
            self.counters["checkpoint_failures"] += 1
            self.disk_warning.warning("checkpoint skipped, the previous one kept: %s", exc)
            return
        self.saved_tokens = self.core.features.t
        self.counters["checkpoints"] += 1

    def on_tick(self, now: float) -> None:
        if self.checkpoint_dir is not None and self.core.features.t != self.saved_tokens and \
                now - self.last_checkpoint >= self.config.predictor.checkpoint_every_s:
            self.checkpoint()

    def on_exit(self, error: Exception | None) -> None:
        if error is None and self.checkpoint_dir is not None and \
                self.core.features.t != self.saved_tokens:
            with self.lock:
                self.checkpoint()

    def _join_cluster(self, manifest, shape: ModelShape | None) -> None:
        """Warm start from the peers whose values have this device's ``shape`` (bounded by
        ``cluster.timeout_s`` per call; Redis down means starting alone), then publish on the
        agent's thread."""
        if shape is None:
            raise ValueError("cluster.redis_url is set but the shapes of the peers' values "
                             "were not given (cluster_shape)")
        link = open_link(self.config, manifest)
        warm = merge(link.fetch_peers(shape))
        if warm is not None:
            apply_to_extractor(self.core, warm, local_tokens=self.core.features.t)
            self.warm_start = warm.summary()
            self.log.info("cluster warm start from %s (%d tokens; PCA of %s)", warm.peers,
                          warm.tokens, warm.source or "none")
        self.cluster = ClusterAgent(link, self._cluster_values, self.name)
        self.cluster.start()

    def _cluster_values(self) -> dict[str, bytes] | None:
        with self.lock:  # a copy of the tables; encoding happens off the service's loop
            patterns = extractor_patterns(self.core, self.cluster.link.device)
        return extractor_values(patterns, time.time_ns()) if patterns.tokens else None

    def sockets(self) -> list[zmq.Socket]:
        return [self.receive.socket]

    def close_sockets(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        self.receive.close()
        self.publisher.close()

    def on_readable(self, sock: zmq.Socket) -> None:
        for message in self.receive.drain(limit=64):  # then the lock is let go a moment
            if not isinstance(message, AccessEvent):
                self.counters["rejected_unexpected"] += 1
                continue
            self.handle_event(message)

    def handle_event(self, event: AccessEvent) -> None:
        self.counters["events"] += 1
        self.gaps.observe(event.source, event.seq, event.epoch)
        started = time.thread_time()
        try:
            out = self.core.on_event(event.sequence, event.position, event.input_token,
                                     event.next_token, event.experts, event.probs)
        except Dropped as exc:
            self.counters[f"dropped_{exc.reason}"] += 1
            self.drop_warning.warning("dropped an access event from %s: %s", event.source, exc)
            return
        finally:
            self.cpu_s += time.thread_time() - started
        if out is None:
            return
        X, z = out
        self.publisher.publish(FeatureBatch(
            self.name, self.epoch, self.seq, event.seq, event.source, event.position + 1,
            event.experts, self.layers, self.core.features.E, z.astype(np.float32).tobytes(),
            z.shape[1], X.astype(np.float16).tobytes(), len(FEATURES),
            float(self.core.pca.variance_kept)))
        self.seq += 1
        self.counters["batches"] += 1

    def stats(self) -> dict:
        events = max(self.counters["events"], 1)
        return {**super().stats(), "resumed_from": self.resumed_from,
                "variance_kept": float(self.core.pca.variance_kept),
                "cpu_ms_per_event": round(1e3 * self.cpu_s / events, 3),
                "tokens_seen": self.core.features.t,
                "token_rows": len(self.core.features.token_row),
                **(cluster_stats(self.cluster.link, self.warm_start)
                   if self.cluster is not None else {})}


def run_feature_extractor_process(config: FlashMoEConfig, events: list[str], publish: str,
                                  control_endpoint: str, warmup: str | None = None,
                                  cluster_shape: ModelShape | None = None,
                                  checkpoint_dir: str | None = None) -> int:
    """``cluster_shape``: what the peers' shared values must look like (needed with
    ``cluster.redis_url``)."""
    prepare_learning_path()  # see common/threads.py
    return run_service_process(lambda: FeatureExtractorService(config, events, publish,
                                                               control_endpoint, warmup,
                                                               cluster_shape, checkpoint_dir),
                               FeatureExtractorService.name)
