"""`flashmoe ablations`: what each mechanism of the learned policy buys, measured where choices
may be made: warm-up on the ``fit`` split, measure on ``dev`` (never ``eval``).

Every variant changes one thing against the defaults (``VARIANTS``); each is warmed up on fit
(its own checkpoint: training-time mechanisms change what is learned) and replayed on dev at
12.5% and 25% of the experts, global scope, beside LRU and Belady on the same dev stream.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path

from common.config import FlashMoEConfig
from common.traces import Trace
from flashmoe.cli.options import (add_config_flags, add_json, add_traces_dir, config, csv, save,
                                  trace_of)
from flashmoe.sim.device_model import DeviceModel, ModelShape
from flashmoe.sim.learning import warmup
from flashmoe.sim.replay import run_bench

# name -> (config changes {section: {field: value}}, what it tests)
VARIANTS: dict[str, tuple[dict, str]] = {
    "default": ({}, "the defaults (linear, no drift handling, a training step every 64 tokens)"),
    "lstm": ({"predictor": {"model": "lstm"}}, "the 2-layer LSTM on the same features"),
    "lstm-seed": ({"predictor": {"model": "lstm", "drift": True, "train_every_tokens": 32}},
                  "the LSTM with drift handling on and a step every 32 tokens"),
    "ewc": ({"predictor": {"ewc_strength": 1.0}}, "EWC on in normal training"),
    "drift": ({"predictor": {"drift": True}}, "the drift detector and its elastic update"),
    "no-pca": ({"features": {"pca_components": 0}}, "the raw 256-dim vector, no PCA"),
    "pca-64": ({"features": {"pca_components": 64}}, "64 principal components, not 128"),
    "pca-96": ({"features": {"pca_components": 96}}, "96 principal components, not 128"),
    "int8": ({"predictor": {"model": "lstm", "int8": True}},
             "the LSTM with INT8 dynamic quantization for inference"),
    "hybrid-0.5": ({"cache": {"policy_params": {"hybrid_share": 0.5}}},
                   "the hybrid: the best-scored half kept, LRU for the rest"),
    "window-16": ({"predictor": {"window_tokens": 16}}, "a 16-token training window"),
    "window-64": ({"predictor": {"window_tokens": 64}}, "a 64-token training window"),
    "lr-x2": ({"predictor": {"learning_rate": 4e-3}}, "twice the learning rates"),
    "train-every-32": ({"predictor": {"train_every_tokens": 32}},
                       "a training step every 32 tokens (twice the training CPU)"),
}


def _apply(config: FlashMoEConfig, changes: dict) -> FlashMoEConfig:
    out = copy.deepcopy(config)
    for section, values in changes.items():
        for name, value in values.items():
            setattr(getattr(out, section), name, value)
    return out


_SHARED: dict = {}


def _variant(name: str) -> tuple[str, dict]:
    changes, _ = VARIANTS[name]
    config = _apply(_SHARED["config"], changes)
    config.cache.policy = "flashmoe"
    folder = Path(_SHARED["scratch"]) / name
    warm = warmup(_SHARED["fit"], config, folder)
    report = run_bench(_SHARED["dev"], "global", _SHARED["fractions"], ["flashmoe"],
                       _SHARED["device"], _SHARED["shape"], jobs=1, progress=False,
                       config=config, warmup=str(folder))
    shutil.rmtree(folder, ignore_errors=True)
    return name, {"warmup": warm, "rows": report["results"]}


def ablations(fit: Trace, dev: Trace, device: DeviceModel, shape: ModelShape,
              config: FlashMoEConfig, names: list[str] | None = None,
              fractions: tuple[float, ...] = (0.125, 0.25), jobs: int = 2) -> dict:
    names = names or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown ablation(s) {unknown}; choices: {', '.join(VARIANTS)}")
    started = time.perf_counter()
    baselines = run_bench(dev, "global", list(fractions), ["lru", "belady"], device, shape,
                          jobs=jobs, progress=False, config=config)
    scratch = tempfile.mkdtemp(prefix="flashmoe-ablations-")
    _SHARED.update(config=config, fit=fit, dev=dev, device=device, shape=shape,
                   fractions=list(fractions), scratch=scratch)
    try:
        with mp.get_context("fork").Pool(jobs) as pool:
            measured = dict(pool.map(_variant, names))
    finally:
        _SHARED.clear()
        shutil.rmtree(scratch, ignore_errors=True)
    base = {(r["policy"], r["capacity"]): r["hits"] for r in baselines["results"]}
    rows = []
    for name in names:
        for r in measured[name]["rows"]:
            lru, belady = base[("lru", r["capacity"])], base[("belady", r["capacity"])]
            rows.append({"variant": name, "what": VARIANTS[name][1], "capacity": r["capacity"],
                         "hit_rate": r["hit_rate"],
                         "gap_closed": round((r["hits"] - lru) / (belady - lru), 4),
                         "cpu_ms_per_token": r["cpu_ms_per_token"],
                         "drifts": r.get("drifts"), "variance_kept": r.get("variance_kept"),
                         "warmup_cpu_ms_per_token": measured[name]["warmup"]["cpu_ms_per_token"]})
    return {"warm_on": fit.name, "measured_on": dev.name, "fractions": list(fractions),
            "baselines": baselines["results"], "rows": rows,
            "wall_s": round(time.perf_counter() - started, 1)}


def format_table(report: dict) -> str:
    caps = sorted({r["capacity"] for r in report["rows"]})
    head = f"{'variant':<12}" + "".join(f" {'hit@' + str(c):>9} {'gap':>6}" for c in caps) + \
        f" {'cpu ms/tok':>10}  what"
    lines = [head, "-" * len(head)]
    by = {(r["variant"], r["capacity"]): r for r in report["rows"]}
    for name in dict.fromkeys(r["variant"] for r in report["rows"]):
        cells = "".join(f" {by[(name, c)]['hit_rate']:>9.4f} {by[(name, c)]['gap_closed']:>6.3f}"
                        for c in caps)
        lines.append(f"{name:<12}{cells} {by[(name, caps[0])]['cpu_ms_per_token']:>10.2f}  "
                     f"{by[(name, caps[0])]['what']}")
    lines.append(f"warm-up on {report['warm_on']}, measured on {report['measured_on']}, global "
                 f"scope; wall {report['wall_s']} s")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", type=csv(str), default=None,
                   help="which ablations (default: all; see flashmoe/bench/ablations.py)")
    p.add_argument("--capacity", type=csv(float), default=[0.125, 0.25])
    p.add_argument("--jobs", type=int, default=2)
    add_traces_dir(p)
    add_json(p)
    add_config_flags(p)


def run(args: argparse.Namespace) -> int:
    from flashmoe.sim.device_model import DEVICES, MODEL_SHAPES

    fit = trace_of(args, "gptoss20b:fit")
    dev = trace_of(args, "gptoss20b:dev")
    report = ablations(fit, dev, DEVICES["orin-980pro"], MODEL_SHAPES[fit.model], config(args),
                       args.variants, tuple(args.capacity), args.jobs)
    print(format_table(report))
    save(args, report)
    return 0
