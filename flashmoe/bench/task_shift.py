"""`flashmoe task-shift`: the eval split is in dataset order in the trace; hit rate in windows
of ``window`` tokens for FlashMoE, LRU, ARC and nextuse at one capacity, with the dataset
switches marked, against the same replay with the sequences shuffled (no shift: the control);
and what the drift detector buys: FlashMoE's hit rate in the ``after`` tokens following each
switch with and without drift handling.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import time

import numpy as np

from common.config import FlashMoEConfig
from common.traces import Trace
from flashmoe.cli.options import (add_config_flags, add_device, add_json, add_plot, add_trace,
                                  add_warmup, config, save, trace_of)
from flashmoe.sim.device_model import DeviceModel, ModelShape
from flashmoe.sim.learning import Learning, LearningPath
from flashmoe.sim.replay import replay_core


def shuffled(trace: Trace, seed: int = 0) -> Trace:
    """The same sequences in a random order."""
    order = np.random.default_rng(seed).permutation(trace.n_sequences)
    rows = np.concatenate([np.arange(trace.offsets[i], trace.offsets[i + 1]) for i in order])
    lengths = np.diff(trace.offsets)[order]
    return Trace(trace.name + ":shuffled", trace.experts[rows],
                 np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), trace.num_experts,
                 trace.model, trace.probs[rows] if trace.probs is not None else None,
                 [trace.sequences[i] for i in order])


def switches(trace: Trace) -> list[tuple[int, str]]:
    """(first token, dataset) of every run of sequences from one dataset."""
    out, last = [], None
    for i, info in enumerate(trace.sequences):
        if info.get("dataset") != last:
            last = info.get("dataset")
            out.append((int(trace.offsets[i]), str(last)))
    return out


_JOB: dict = {}


def _replay(job: tuple[str, str, dict]) -> tuple[str, str, np.ndarray]:
    policy, variant, overrides = job
    trace = _JOB["traces"][variant]
    config = copy.deepcopy(_JOB["config"])
    for section, values in overrides.items():
        for name, value in values.items():
            setattr(getattr(config, section), name, value)
    hooks = None
    if policy == "flashmoe":
        learning = Learning.create(trace.num_layers, trace.num_experts, trace.top_k, config)
        if _JOB["warmup"]:
            learning.load(_JOB["warmup"])
        hooks = LearningPath(trace, learning, config.predictor.publish_interval_ms)
    device, shape = _JOB["device"], _JOB["shape"]
    run = replay_core(policy, _JOB["capacity"], trace, "global", device, shape.expert_bytes,
                      device.compute_ms_per_layer(shape), hooks=hooks)
    per_token = run.hits.reshape(trace.n_tokens, trace.num_layers).sum(1)
    return policy, variant, per_token


def task_shift(trace: Trace, capacity: int, device: DeviceModel, shape: ModelShape,
               config: FlashMoEConfig, warmup: str | None, window: int = 200,
               after: int = 1000, jobs: int = 2) -> dict:
    traces = {"ordered": trace, "shuffled": shuffled(trace)}
    policies = ["flashmoe", "lru", "arc", "nextuse"]
    work = [(p, v, {}) for v in traces for p in policies]
    # What drift handling buys, on against off whatever the default: the curves above run
    # the defaults; the other setting is one more replay.
    other = not config.predictor.drift
    toggled = "ordered-drift" if other else "ordered-nodrift"
    work.append(("flashmoe", toggled, {"predictor": {"drift": other}}))
    traces[toggled] = trace
    on, off = (toggled, "ordered") if other else ("ordered", toggled)
    _JOB.update(traces=traces, config=config, warmup=warmup, capacity=capacity,
                device=device, shape=shape)
    started = time.perf_counter()
    with mp.get_context("fork").Pool(jobs) as pool:
        results = pool.map(_replay, work)
    _JOB.clear()
    accesses_per_token = trace.num_layers * trace.top_k
    curves: dict = {}
    for policy, variant, per_token in results:
        n = len(per_token) // window
        windows = per_token[:n * window].reshape(n, window).sum(1) / (window * accesses_per_token)
        curves.setdefault(variant, {})[policy] = {
            "hit_rate": round(float(per_token.sum() / (len(per_token) * accesses_per_token)), 6),
            "windows": [round(float(w), 4) for w in windows], "per_token": per_token}
    marks = switches(trace)
    drift = []
    for start, dataset in marks[1:]:
        stop = min(start + after, trace.n_tokens)
        span = (stop - start) * accesses_per_token
        with_drift = curves[on]["flashmoe"]["per_token"][start:stop].sum() / span
        without = curves[off]["flashmoe"]["per_token"][start:stop].sum() / span
        drift.append({"token": start, "dataset": dataset, "with_drift": round(float(with_drift), 4),
                      "without_drift": round(float(without), 4)})
    for variant in curves.values():
        for entry in variant.values():
            del entry["per_token"]
    return {"trace": trace.name, "capacity": capacity, "window": window, "after": after,
            "switches": [{"token": t, "dataset": d} for t, d in marks],
            "curves": curves, "drift": drift, "warmup": bool(warmup),
            "wall_s": round(time.perf_counter() - started, 1)}


def plot_task_shift(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = report["window"]
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True, sharey=True)
    for ax, variant, title in ((axes[0], "ordered", "dataset order (task switches marked)"),
                               (axes[1], "shuffled", "sequences shuffled (no-shift control)")):
        for policy, entry in report["curves"][variant].items():
            x = (np.arange(len(entry["windows"])) + 0.5) * window
            ax.plot(x, entry["windows"], label=f"{policy} ({entry['hit_rate']:.3f})",
                    linewidth=1.2 if policy == "flashmoe" else 0.8)
        if variant == "ordered":
            for mark in report["switches"][1:]:
                ax.axvline(mark["token"], color="grey", linestyle=":", linewidth=0.8)
                ax.text(mark["token"], 0.98, mark["dataset"][:14], rotation=90, fontsize=6,
                        va="top", color="grey", transform=ax.get_xaxis_transform())
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(f"hit rate per {window} tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[1].set_xlabel("token of the eval split")
    fig.suptitle(f"{report['trace']}, global scope, {report['capacity']} experts")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_trace(p)
    p.add_argument("--capacity", type=float, default=0.125, help="fraction of all experts")
    add_warmup(p)
    p.add_argument("--window", type=int, default=200, help="tokens per plotted point")
    p.add_argument("--after", type=int, default=1000, help="tokens after a switch (drift)")
    add_device(p)
    add_json(p)
    add_plot(p)
    add_config_flags(p)


def run(args: argparse.Namespace) -> int:
    from flashmoe.sim.device_model import DEVICES, MODEL_SHAPES
    from flashmoe.sim.replay import capacity_for

    trace = trace_of(args)
    report = task_shift(trace, capacity_for(args.capacity, trace, "global"),
                        DEVICES[args.device], MODEL_SHAPES[trace.model], config(args),
                        args.warmup, args.window, args.after)
    for variant, curves in report["curves"].items():
        print(variant, {p: c["hit_rate"] for p, c in curves.items()})
    for row in report["drift"]:
        print(f"after the switch to {row['dataset']} at token {row['token']}: FlashMoE "
              f"{row['with_drift']:.4f} with drift handling, {row['without_drift']:.4f} without")
    save(args, report, plot_task_shift)
    return 0
