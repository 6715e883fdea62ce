"""`flashmoe cluster-bench`: what a warm start from a peer is worth.

A peer device serves the gpt-oss-20b train split (its first ``warmup_tokens`` tokens, one pass,
as a device learns live) and publishes its features to a real Redis (common/cluster.py, the
code the services run); a new device then merges them and serves the eval split. The figure
is the hit rate over the new device's first ``tokens`` tokens (the flashmoe policy, global
scope, ``fraction`` of all experts cached, through the simulator's cache-manager core and the
learning path on its virtual clock), against a cold start (nothing learned) and against a
local `flashmoe warmup` checkpoint made from the same train tokens (two passes, its
default). LRU is listed for scale.

Without ``--redis`` a private ``redis-server`` is started on a free port and stopped at the
end. There is no store here, so the keys' model fingerprint is made from the trace's model
identity (model, layers, experts, top-k); the bench removes its keys when done.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from common.cluster import (
    PARTS,
    ClusterLink,
    extractor_values,
    key,
    merge,
    model_fingerprint,
    predictor_values,
)
from common.config import FlashMoEConfig
from flashmoe.bench.local import RedisServer
from flashmoe.cli.options import (add_config_flags, add_device, add_json, add_plot,
                                  add_traces_dir, config, save, traces_dir)
from common.traces import DEFAULT_TRACES_DIR, TokenStream, Trace, first_sequences, load_trace
from flashmoe.sim.device_model import DEVICES, shape_for_trace
from flashmoe.sim.learning import Learning, LearningPath, cluster_shape, warmup
from flashmoe.sim.replay import capacity_for, replay_core
from services.feature_extractor.sharing import apply_to_extractor, extractor_patterns
from services.predictor.sharing import learner_patterns, write_predictor_checkpoint

PEER, DEVICE = "peer-train", "new-device"
EARLY = (100, 250, 500)  # also reported: the hit rate over the first this many tokens


def _link(config: FlashMoEConfig, url: str, device: str, fingerprint: str) -> ClusterLink:
    return ClusterLink(dataclasses.replace(config.cluster, redis_url=url, device_id=device),
                       fingerprint)


def _serve(trace: Trace, learning: Learning) -> None:
    """A device serving ``trace``: its learning path sees every token once, in order."""
    stream = TokenStream.of(trace)
    for t in range(trace.n_tokens):
        learning.on_token(stream, trace, t)


def _hit_rates(hits: np.ndarray, trace: Trace, tokens: int) -> dict:
    per_token = trace.num_layers * trace.top_k
    out = {}
    for n in (*[e for e in EARLY if e < tokens], tokens):
        out[str(n)] = round(float(hits[:n * trace.num_layers].sum()) / (n * per_token), 4)
    return out


def cluster_bench(config: FlashMoEConfig, workdir: Path, redis_url: str | None = None,
                  tokens: int = 1000, fraction: float = 0.25, warmup_tokens: int = 12_000,
                  device: str = "orin-980pro", traces_dir: Path = DEFAULT_TRACES_DIR,
                  say=print) -> dict:

    workdir.mkdir(parents=True, exist_ok=True)
    train = first_sequences(load_trace("gptoss20b:train", traces_dir), warmup_tokens)
    evaluation = first_sequences(load_trace("gptoss20b:eval", traces_dir), tokens, cover=True)
    tokens = min(tokens, evaluation.n_tokens)
    L, E, K = train.num_layers, train.num_experts, train.top_k
    fingerprint = model_fingerprint({"model": train.model, "layers": L, "experts": E,
                                     "top_k": K})
    shape = cluster_shape(L, E, config)
    server = RedisServer().start() if redis_url is None else None
    url = redis_url or server.url
    arms: dict[str, Learning | None] = {}
    exchange: dict = {}
    try:
        started = time.perf_counter()
        say(f"[cluster-bench] the peer serves {train.name} ({train.n_tokens} tokens) and "
            f"publishes to {url}")
        peer = Learning.create(L, E, K, config)
        _serve(train, peer)
        peer_link = _link(config, url, PEER, fingerprint)
        weights, meta = learner_patterns(peer.learner)
        values = {**extractor_values(extractor_patterns(peer.extractor, PEER), time.time_ns()),
                  **predictor_values(PEER, meta["tokens"], weights, meta, time.time_ns())}
        if not peer_link.publish(values):
            raise RuntimeError(f"the peer could not publish: {peer_link.status()['reason']}")
        exchange["published_bytes"] = sum(len(v) for v in values.values())
        exchange["peer_serve_s"] = round(time.perf_counter() - started, 1)

        link = _link(config, url, DEVICE, fingerprint)
        warm = merge(link.fetch_peers(shape))
        if warm is None or warm.predictor is None:
            raise RuntimeError(f"the new device found no usable peer: {link.status()}")
        exchange.update(warm.summary(), garbage=link.status()["n_garbage"])
        from_peer = Learning.create(L, E, K, config)
        apply_to_extractor(from_peer.extractor, warm)
        from_peer.learner.load(write_predictor_checkpoint(warm, workdir / "from-peer"))

        local = workdir / f"warmup-{train.n_tokens}"
        if not (local / "predictor.json").is_file():
            say(f"[cluster-bench] a local `flashmoe warmup` on the same {train.n_tokens} "
                f"tokens (first use only)")
            warmup(train, config, local)
        from_local = Learning.create(L, E, K, config)
        from_local.load(local)
        arms = {"cold start": Learning.create(L, E, K, config),
                "warm start from a peer (Redis)": from_peer,
                "local --warmup checkpoint": from_local, "lru (no learning)": None}
    finally:
        if server is not None:
            server.stop()
        else:
            _forget(url, config, fingerprint)

    dev = DEVICES[device]
    model = shape_for_trace(evaluation, None, None)
    capacity = capacity_for(fraction, evaluation, "global")
    rows = []
    for name, learning in arms.items():
        started = time.perf_counter()
        policy = "lru" if learning is None else "flashmoe"
        hooks = None if learning is None else LearningPath(
            evaluation, learning, config.predictor.publish_interval_ms)
        run = replay_core(policy, capacity, evaluation, "global", dev,
                          model.expert_bytes if model else 0,
                          dev.compute_ms_per_layer(model) if model else 0.0,
                          params=config.cache.policy_params if policy == config.cache.policy
                          else None, hooks=hooks)
        rates = _hit_rates(run.hits, evaluation, tokens)
        rows.append({"arm": name, "policy": policy, "hit_rate": rates[str(tokens)],
                     "hit_rate_first": rates, "wall_s": round(time.perf_counter() - started, 1)})
        say(f"[cluster-bench] {name}: hit rate {rates[str(tokens)]:.4f}")
    return {"trace": evaluation.name, "tokens": tokens, "scope": "global",
            "capacity_fraction": fraction, "capacity_experts": capacity, "device": device,
            "peer_trace": train.name, "fingerprint": fingerprint, "exchange": exchange,
            "rows": rows}


def _forget(url: str, config: FlashMoEConfig, fingerprint: str) -> None:
    """Remove the bench's keys from a Redis it did not start."""
    link = _link(config, url, DEVICE, fingerprint)
    link.call(lambda client: client.delete(*[key(fingerprint, device, what)
                                             for device in (PEER, DEVICE) for what in PARTS]))
    link.close()


def format_table(report: dict) -> str:
    early = [k for k in report["rows"][0]["hit_rate_first"] if k != str(report["tokens"])]
    head = (f"hit rate over the first {report['tokens']} tokens of {report['trace']} "
            f"(global scope, {report['capacity_experts']} experts = "
            f"{report['capacity_fraction']:.0%} cached; peer served {report['peer_trace']})")
    cols = "".join(f"{'first ' + k:>11}" for k in early)
    lines = [head, f"{'start':<32}{'policy':<10}{'hit rate':>10}{cols}"]
    for row in report["rows"]:
        lines.append(f"{row['arm']:<32}{row['policy']:<10}{row['hit_rate']:>10.4f}" +
                     "".join(f"{row['hit_rate_first'][k]:>11.4f}" for k in early))
    ex = report["exchange"]
    lines.append(f"exchange: {ex['published_bytes']} bytes published by {PEER}, merged from "
                 f"{ex['peers']} ({ex['tokens']} tokens), predictor from {ex['predictor_from']}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Cumulative hit rate over the first tokens, one line per start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in report["rows"]:
        points = sorted((int(k), v) for k, v in row["hit_rate_first"].items())
        ax.plot([k for k, _ in points], [v for _, v in points], marker="o", label=row["arm"])
    ax.set_xscale("log")
    ax.set_xlabel(f"first tokens of {report['trace']}")
    ax.set_ylabel("hit rate")
    ax.set_title(f"warm start from a peer ({report['capacity_fraction']:.0%} of the experts)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=".flashmoe/cluster-bench", help="the local warm-up")
    p.add_argument("--tokens", type=int, default=1000, help="first tokens of the eval split")
    p.add_argument("--capacity", type=float, default=0.25, help="fraction of all experts")
    p.add_argument("--warmup-tokens", type=int, default=12_000,
                   help="train-split tokens the peer served (and the local warm-up uses)")
    add_device(p)
    add_traces_dir(p)
    add_json(p)
    add_plot(p)
    add_config_flags(p)  # --redis URL: that Redis, else a private redis-server


def run(args: argparse.Namespace) -> int:
    settings = config(args, first=["cache.policy=flashmoe"])
    report = cluster_bench(settings, Path(args.workdir), settings.cluster.redis_url or None,
                           args.tokens, args.capacity, args.warmup_tokens, args.device,
                           traces_dir(args))
    print(format_table(report))
    save(args, report, plot)
    return 0
