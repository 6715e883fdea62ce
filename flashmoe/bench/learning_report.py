"""`flashmoe learning-report`: recall@4 per layer of the next-token prediction (the
predictor's chance of use in the coming token) and of the next-layer prediction (the inline
prefetcher, after each layer of the current token), against reusing the previous token's
experts and against a static hot list (the most used experts of each layer on the warm-up
split); and INT8 dynamic quantization against FP32: the network's size, inference time and hit
rates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from common.config import FlashMoEConfig
from common.traces import TokenStream, Trace
from flashmoe.cli.options import (add_config_flags, add_json, add_trace, add_warmup, config, csv,
                                  save, trace_of)
from flashmoe.sim.hooks import SIM_WORKER
from flashmoe.sim.learning import Learning
from services.predictor.core import next_token_recall_per_layer, recall_at


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_trace(p)
    p.add_argument("--warmup-trace", default="gptoss20b:train",
                   help="the split the static hot list comes from")
    add_warmup(p)
    p.add_argument("--capacity", type=csv(float), default=[0.125, 0.25])
    add_json(p)
    add_config_flags(p)


def run(args: argparse.Namespace) -> int:
    from flashmoe.sim.device_model import DEVICES, MODEL_SHAPES
    from flashmoe.sim.replay import run_bench
    from services.predictor import fast_infer

    trace = trace_of(args)
    settings = config(args)
    recall = recall_report(trace_of(args, args.warmup_trace), trace, settings,
                           args.warmup)
    learning = Learning.create(trace.num_layers, trace.num_experts, trace.top_k, settings)
    if args.warmup:
        learning.load(args.warmup)
    precision = precision_report(learning)
    hit_rates = {}
    variants = {f"heads_{p}": {"infer_precision": p} for p in fast_infer.PRECISIONS}
    if settings.predictor.model == "lstm":
        variants["torch_int8_lstm"] = {"int8": True}
    for name, change in variants.items():
        variant = dataclasses.replace(settings, predictor=dataclasses.replace(
            settings.predictor, **change))
        report = run_bench(trace, "global", args.capacity, ["flashmoe"], DEVICES["orin-980pro"],
                           MODEL_SHAPES[trace.model], progress=False, config=variant,
                           warmup=args.warmup)
        hit_rates[name] = {
            r["capacity"]: {"hit_rate": r["hit_rate"], "cpu_ms_per_token": r["cpu_ms_per_token"]}
            for r in report["results"]}
    doc = {"trace": trace.name, "warmup": Path(args.warmup).name if args.warmup else None,
           "model": settings.predictor.model, "recall_at_k": recall,
           "precision": {**precision, "bench": hit_rates}}
    for name, entry in recall.items():
        print(f"recall@{trace.top_k} {name}: {entry['mean']:.3f}")
    print(json.dumps(doc["precision"], indent=1))
    save(args, doc)
    return 0
