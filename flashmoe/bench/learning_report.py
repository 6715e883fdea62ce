"""The learned policy's own figures (`flashmoe task-shift`, `flashmoe learning-report`).

task-shift: the eval split is in dataset order in the trace; hit rate in windows of
``window`` tokens for FlashMoE, LRU, ARC and nextuse at one capacity, with the dataset
switches marked, against the same replay with the sequences shuffled (no shift: the control);
and what the drift detector buys: FlashMoE's hit rate in the ``after`` tokens following each
switch with and without drift handling.

learning-report: recall@4 per layer of the next-token prediction (the predictor's chance of
use in the coming token) and of the next-layer prediction (the inline prefetcher, after each
layer of the current token), against reusing the previous token's experts and against a
static hot list (the most used experts of each layer on the warm-up split); and INT8 dynamic
quantization against FP32: the network's size, inference time and hit rates.
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing as mp
import time

import numpy as np

from common.config import FlashMoEConfig
from common.traces import TokenStream, Trace
from flashmoe.sim.device_model import DeviceModel, ModelShape
from flashmoe.sim.learning import Learning, LearningPath
from services.predictor.core import next_token_recall_per_layer, recall_at
from flashmoe.sim.hooks import SIM_WORKER
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


# --- recall and INT8 ----------------------------------------------------------------------------

def recall_report(warmup_trace: Trace, trace: Trace, config: FlashMoEConfig,
                  warmup: str | None) -> dict:
    """recall@k per layer of the next-token and next-layer predictions and two baselines."""
    from services.cache_manager.core import CacheManagerCore
    from services.cache_manager.prefetcher import NextLayerPrefetcher

    L, E, K = trace.num_layers, trace.num_experts, trace.top_k
    learning = Learning.create(L, E, K, config)
    if warmup:
        learning.load(warmup)
    prefetcher = NextLayerPrefetcher(L, E, K, dataclasses.replace(
        NextLayerPrefetcher(L, E, K).params, threshold=2.0))  # scores only, no hints
    sink = CacheManagerCore({(0, 0): 1}, 1)
    stream = TokenStream.of(trace)
    counts = np.zeros((L, E))
    for row in warmup_trace.experts:
        np.add.at(counts, (np.arange(L)[:, None], row), 1)
    hot = np.argsort(-counts, axis=1)[:, :K]
    sums = {name: np.zeros(L) for name in ("next_token", "next_layer", "previous_token",
                                           "hot_list")}
    n = {name: 0 for name in sums}
    previous = None
    for t in range(trace.n_tokens):
        actual = trace.experts[t].astype(np.int64)
        p_used = learning.learner.last_p_used
        if p_used is not None and stream.position[t] > 0:
            sums["next_token"] += next_token_recall_per_layer(p_used, actual)
            n["next_token"] += 1
        if previous is not None and stream.position[t] > 0:
            sums["previous_token"] += recall_at(previous, actual)
            n["previous_token"] += 1
        sums["hot_list"] += recall_at(hot, actual)
        n["hot_list"] += 1
        for layer in range(L):
            prefetcher.after_request(sink, SIM_WORKER, layer, actual[layer].tolist(),
                                     stream.input_token[t])
            if layer + 1 < L:
                X = prefetcher._streams[SIM_WORKER]["X"][layer + 1]
                p = X @ prefetcher.w + prefetcher.b[layer + 1]
                top = np.argsort(-p)[:K]
                sums["next_layer"][layer + 1] += np.isin(top, actual[layer + 1]).sum() / K
        n["next_layer"] += 1
        learning.on_token(stream, trace, t)
        previous = actual
    out = {}
    for name, total in sums.items():
        per_layer = total / max(n[name], 1)
        layers = per_layer[1:] if name == "next_layer" else per_layer
        out[name] = {"mean": round(float(layers.mean()), 4),
                     "per_layer": [round(float(v), 4) for v in per_layer]}
    return out


COLD_PAUSE_S = 0.05  # between the calls of a cold timing: about a token of a slow decode
COLD_CALLS = 30


def precision_report(learning: Learning, steps: int = 200, cold_calls: int = COLD_CALLS) -> dict:
    """Bytes and one-token inference time of the predictor at each inference precision: the
    fused C inference with the per-layer heads in fp32, bf16 or int8 (one scale per output),
    the numpy reference path, and for an LSTM, torch's INT8 dynamic quantization (its LSTM
    weight matrices in int8, one scale each; the heads stay fp32).

    Each is timed twice: ``infer_us``, back to back (the caches hot), and ``infer_us_cold``,
    the median CPU time of calls ``COLD_PAUSE_S`` apart, as a live predictor makes them: it
    sleeps between tokens while the worker runs, and wakes with its weights out of the caches,
    so that the bytes it reads, more than its arithmetic, set its cost."""
    import torch

    from services.predictor import fast_infer

    learner = learning.learner
    net = learner.net
    total = sum(p.numel() for p in net.parameters())
    heads = net.head.numel()
    rng = np.random.default_rng(0)
    z = rng.standard_normal((learner.L, learner.dims)).astype(np.float32)
    x = rng.random((learner.N, learner.features)).astype(np.float32)

    def timed(call) -> float:
        call()
        started = time.perf_counter()
        for _ in range(steps):
            call()
        return round((time.perf_counter() - started) / steps * 1e6, 1)

    def cold(call) -> float:
        spent = []
        for _ in range(cold_calls):
            time.sleep(COLD_PAUSE_S)
            started = time.thread_time()
            call()
            spent.append(time.thread_time() - started)
        return round(float(np.median(spent)) * 1e6, 1)

    def both(call) -> dict:
        return {"infer_us": timed(call), "infer_us_cold": cold(call)}

    out = {"parameters": total, "head_parameters": heads,
           "numpy_fp32": {"bytes": 4 * total, **both(lambda: net.step(z, x))}}
    if fast_infer.load() is not None:
        h, _ = net.recurrent_step(z)
        for precision in fast_infer.PRECISIONS:
            fused = fast_infer.FusedInference(net, precision)
            heads_bytes = fused.head.nbytes + (
                fused.scale.nbytes if fused.scale is not None else 0)
            out[f"fused_{precision}"] = {"bytes": 4 * (total - heads) + heads_bytes,
                                         **both(lambda: fused(h, x))}
    if net.lstm is not None:
        lstm = sum(p.numel() for name, p in net.lstm.named_parameters() if "weight" in name)
        learner.quantize()
        int8, learner.infer_net = learner.infer_net, net
        zt, xt = torch.from_numpy(z)[None], torch.from_numpy(x)[None]
        with torch.no_grad():
            out["torch_int8_lstm"] = {"bytes": 4 * (total - lstm) + lstm,
                                      **both(lambda: int8(zt, xt))}
    return out
