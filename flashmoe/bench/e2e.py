"""`flashmoe e2e-bench`: tokens per second end to end, on real IO, against the page-cache way.

One store (random bf16 experts of gpt-oss-20b's shape, `synth-store` at ``scale``), one RAM
budget (a fraction of all experts' bytes), one trace slice (the first ``tokens`` decode steps
of the eval split), and these modes, interleaved in rounds (this disk's speed drifts), the
page cache dropped before every run of every mode:

  flashmoe  the whole system: cache manager (learned policy, inline prefetch), feature
            extractor, predictor (from the warm-up checkpoint), and the trace-driven worker
            computing every layer's experts on the fetched weights;
  lru       the same worker and cache manager with LRU and no prefetch, no learning path;
  mmap      what llama.cpp does with a GGUF: every expert in one file, memory-mapped, read
            through the OS page cache by the same worker compute; the worker and its page cache
            held to the budget by a memory cgroup (v2 ``memory.max`` or v1
            ``memory.limit_in_bytes``); skipped with the reason where neither can be written;
  ram       every expert in RAM (the ceiling).

Per mode: tokens/s, ms/token p50 and p99, SSD MB/s, bytes read, peak PSS (the shared arena
counted once), and the stall-free rate (flashmoe and lru: the requests whose expert was
resident when asked for, prefetches that landed in time included).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.store import ExpertStore
from flashmoe.cli.options import (add_json, add_plot, add_set, add_trace, add_warmup, csv, save,
                                  trace_of)
from flashmoe.bench.io import drop_page_cache
from flashmoe.runtime.launch import Launcher, child_env, stop_process

MODES = ("flashmoe", "lru", "mmap", "ram")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")
COMPUTE_HEADROOM = 4  # experts' worth of float32 temporaries the mmap worker may allocate
WARMUP_SPLIT = "gptoss20b:train"  # the default warm-up's routing


# --- the memory budget ---------------------------------------------------------------------------

class MemoryCgroup:
    """A child memory cgroup holding a process and its page cache to ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        name = f"flashmoe-e2e-{os.getpid()}-{random.randrange(1 << 30):x}"
        if (CGROUP_V2 / "cgroup.controllers").is_file() and \
                "memory" in (CGROUP_V2 / "cgroup.controllers").read_text():
            self.path, self.limit_file, self.version = CGROUP_V2 / name, "memory.max", 2
        elif (CGROUP_V1 / "memory.limit_in_bytes").is_file():
            self.path, self.limit_file, self.version = CGROUP_V1 / name, \
                "memory.limit_in_bytes", 1
        else:
            raise PermissionError("no memory cgroup (v2 memory.max nor v1 "
                                  "memory.limit_in_bytes) is available here")
        self.path.mkdir()
        try:
            (self.path / self.limit_file).write_text(str(limit))
        except OSError:
            self.path.rmdir()
            raise

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def cgroup_unavailable_reason() -> str | None:
    try:
        MemoryCgroup(1 << 30).close()
        return None
    except (OSError, PermissionError) as exc:
        return str(exc)


# --- measuring processes ------------------------------------------------------------------------

def pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def read_bytes(pid: int) -> int:
    """Bytes the process (and only it) made the block layer read."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class PeakPss:
    """Sum of the PSS of a set of processes, sampled until stopped; keeps the peak."""

    def __init__(self, pids, every_s: float = 0.2) -> None:
        self.pids, self.every_s = pids, every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, sum(pss_bytes(pid) for pid in self.pids()))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@dataclass
class Run:
    mode: str
    budget_fraction: float
    token_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    bytes_read: int = 0
    peak_pss_bytes: int = 0
    stall_free_rate: float | None = None
    extra: dict = field(default_factory=dict)
    precision: str = "native"
    precision_mix: dict = field(default_factory=dict)  # precision -> share of router weight


# --- the flat expert file of the mmap and ram modes ---------------------------------------------

def flat_file(store: ExpertStore, path: Path) -> Path:
    """Every expert's bytes back to back, layer by layer (a GGUF's expert tensors), with an
    index of (offset, nbytes) per expert; made once."""
    index = path.with_suffix(".json")
    if index.is_file() and path.is_file():
        return path
    entries = {}
    offset = 0
    with open(path, "wb") as out, contextlib.ExitStack() as files:
        stripes = [files.enter_context(open(p, "rb")) for p in store.stripe_paths]
        for e in store.manifest.experts:
            data = bytearray(e.n_blocks * store.manifest.block_size)
            for op in store.read_ops(e.layer, e.expert, 0):
                f = stripes[int(op["file_index"])]
                f.seek(int(op["file_offset"]))
                start = int(op["buf_offset"])
                data[start:start + int(op["length"])] = f.read(int(op["length"]))
            out.write(data[:e.nbytes])
            pad = -e.nbytes % 4096
            out.write(b"\0" * pad)
            entries[f"{e.layer},{e.expert}"] = [offset, e.nbytes]
            offset += e.nbytes + pad
        out.flush()
        os.fsync(out.fileno())
    index.write_text(json.dumps({"store": str(store.path), "experts": entries}))
    return path


# --- one run of one mode ------------------------------------------------------------------------

def _worker_timings(path: Path) -> list[float]:
    doc = json.loads(path.read_text())
    return doc.get("token_ms", [])


def _learner_cpu(launcher: Launcher) -> dict:
    """The learning path's CPU a token (the extractor's and the predictor's learning threads),
    from their control sockets, as `flashmoe run` reports it; empty if they do not answer."""
    from common.bus import ServiceUnavailable, stats
    from flashmoe.runtime.run import learner_cpu_by_stage

    try:
        stages = learner_cpu_by_stage(
            stats(launcher.children["feature_extractor"].control_endpoint, timeout_s=5.0),
            stats(launcher.children["predictor"].control_endpoint, timeout_s=5.0))
    except (ServiceUnavailable, KeyError):
        return {}
    return {"learner_cpu_ms_per_token": round(sum(stages.values()), 3),
            "learner_cpu_ms_by_stage": stages}


def run_system(mode: str, store: str, warmup: str | None, trace: str, tokens: int,
               capacity: int, workdir: Path, budget: float, settings: tuple[str, ...] = (),
               precision: str = "native", fractions: str = "") -> Run:
    """flashmoe or lru: the cache manager (+ the learning path for flashmoe, from the
    ``warmup`` checkpoint, or cold without one) and the worker. ``settings``: further config
    overrides of the flashmoe mode (``--set``); ``precision``: cache.precision (``fractions``:
    random's cache.precision_fractions)."""
    overrides = [f"store.path={store}", f"cache.capacity_experts={capacity}",
                 f"cache.precision={precision}"]
    if fractions:
        overrides.append(f"cache.precision_fractions={fractions}")
    if mode == "flashmoe":
        overrides += ["cache.policy=flashmoe", "prefetch.inline=true", *settings]
    else:
        overrides += ["cache.policy=lru", "prefetch.inline=false"]
    from common.config import load_config

    # Sockets live in the runtime folder: a short path (an ipc address has 107 bytes at most).
    runtime = Path(tempfile.mkdtemp(prefix=f"flashmoe-e2e-{mode}-"))
    launcher = Launcher(load_config(env={}, overrides=overrides), runtime)
    events = launcher.endpoint("worker.events")
    try:
        if mode == "flashmoe":
            start_from = ["--warmup", warmup] if warmup else []
            launcher.start("predictor", ["serve-predictor", store, "--features",
                                         launcher.endpoint("feature_extractor"),
                                         "--checkpoint-dir", str(runtime / "ckpt"),
                                         *start_from])
            launcher.start("feature_extractor", ["serve-features", store, "--events", events,
                                                 *start_from])
            cache = launcher.start("cache_manager", ["serve-cache", store, "--predictions",
                                                     launcher.endpoint("predictor")])
        else:
            cache = launcher.start("cache_manager", ["serve-cache", store])
        out = runtime / "worker.json"
        cmd = ["trace-worker", "--cache", cache.endpoint, "--trace", trace, "--tokens",
               str(tokens), "--compute", "--json", str(out)]
        if mode == "flashmoe":
            cmd += ["--events", events]
        worker = launcher.start_plain("worker", cmd)
        pids = lambda: [c.proc.pid for c in launcher.children.values()] + [worker.pid]  # noqa
        peak = PeakPss(pids)
        started = time.perf_counter()
        worker.wait()
        wall = time.perf_counter() - started
        learner = _learner_cpu(launcher) if mode == "flashmoe" else {}
        run = Run(mode, budget, peak_pss_bytes=peak.stop(), precision=precision)
        if worker.returncode != 0:
            raise RuntimeError(f"{mode} worker failed: {(runtime / 'worker.log').read_text()[-2000:]}")
        stats = json.loads(out.read_text())
        run.token_ms = stats.get("token_ms", [])
        run.wall_s = wall
        run.bytes_read = stats["n_byte_read"]
        run.stall_free_rate = round(stats["n_hit"] / max(stats["n_hit"] + stats["n_miss"], 1), 4)
        run.extra = {k: stats.get(k) for k in ("n_hit", "n_miss", "n_hit_loading",
                                               "prefetch_issued", "prefetch_learned",
                                               "prefetch_used", "prefetch_wasted",
                                               "estimates_used", "engine",
                                               "n_load_native", "n_load_int8",
                                               "n_load_int4")}
        run.precision_mix = stats.get("precision_mix") or {}
        run.extra.update(learner)
        return run
    finally:
        launcher.stop_all()
        shutil.rmtree(runtime, ignore_errors=True)


def run_flat(mode: str, flat: Path, store: str, trace: str, tokens: int, budget_bytes: int,
             workdir: Path, budget: float) -> Run:
    """mmap (the page cache, held to the budget by a cgroup) or ram (everything read in)."""
    out = Path(tempfile.mkdtemp(prefix=f"flashmoe-e2e-{mode}-", dir=workdir)) / "worker.json"
    cmd = [sys.executable, "-m", "flashmoe.bench.flat_worker", "--file", str(flat), "--store",
           store, "--trace", trace, "--tokens", str(tokens), "--json", str(out)]
    if mode == "ram":
        cmd.append("--in-ram")
    group = None
    if mode == "mmap":
        # The worker joins the cgroup once its interpreter and torch are loaded (memory
        # already charged stays outside it): the budget holds the page cache of the expert
        # file plus what the compute allocates while it runs (COMPUTE_HEADROOM experts'
        # worth of float32 copies and 64 MiB for the interpreter's own growth), as the other
        # modes' arena holds the experts alone.
        headroom = COMPUTE_HEADROOM * ExpertStore.open(store).manifest.max_expert_bytes * 2 \
            + (64 << 20)
        group = MemoryCgroup(budget_bytes + headroom)
        cmd += ["--cgroup", str(group.path)]
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    peak = PeakPss(lambda: [proc.pid])
    started = time.perf_counter()
    try:
        _, err = proc.communicate(timeout=3600)
    finally:
        wall = time.perf_counter() - started
        peak_pss = peak.stop()
        if proc.poll() is None:
            stop_process(proc)
        if group is not None:
            group.close()
    if proc.returncode != 0:
        why = err[-2000:] or f"exit status {proc.returncode}"
        if proc.returncode == -9 and group is not None:
            why += " (killed: out of memory in its cgroup)"
        raise RuntimeError(f"{mode} worker failed: {why}")
    stats = json.loads(out.read_text())
    shutil.rmtree(out.parent, ignore_errors=True)
    return Run(mode, budget, stats["token_ms"], wall, stats["read_bytes"], peak_pss, None,
               {"load_s": stats.get("load_s"),
                "cgroup_limit_bytes": group.limit if group is not None else None})


# --- the benchmark ------------------------------------------------------------------------------

def contender_name(mode: str, precision: str) -> str:
    """A contender's name: its mode, and its precision where not native."""
    return mode if precision == "native" else f"{mode}-{precision}"


def summarize(runs: list[Run], tokens: int) -> dict:
    ms = np.concatenate([np.asarray(r.token_ms, float) for r in runs]) if runs else np.zeros(0)
    tok_s = [tokens / (sum(r.token_ms) / 1e3) for r in runs if r.token_ms]
    first = runs[0]
    bytes_read = statistics.median([r.bytes_read for r in runs])
    seconds = statistics.median([sum(r.token_ms) / 1e3 for r in runs])
    mixes = [r.precision_mix for r in runs if r.precision_mix]
    mix = {p: round(statistics.mean(m.get(p, 0.0) for m in mixes), 4)
           for p in sorted({p for m in mixes for p in m})} if mixes else \
        ({first.precision: 1.0} if first.mode in ("flashmoe", "lru") else {"native": 1.0})
    return {"mode": first.mode, "precision": first.precision, "precision_mix": mix,
            "budget_fraction": first.budget_fraction, "rounds": len(runs),
            "tokens_per_s": round(statistics.median(tok_s), 3),
            "tokens_per_s_min": round(min(tok_s), 3), "tokens_per_s_max": round(max(tok_s), 3),
            "ms_per_token_p50": round(float(np.percentile(ms, 50)), 2),
            "ms_per_token_p99": round(float(np.percentile(ms, 99)), 2),
            "ssd_mb_per_s": round(bytes_read / seconds / 1e6, 1) if seconds else None,
            "bytes_read": int(bytes_read), "bytes_per_token": int(bytes_read / tokens),
            "peak_pss_bytes": int(statistics.median([r.peak_pss_bytes for r in runs])),
            "stall_free_rate": (statistics.median([r.stall_free_rate for r in runs])
                                if first.stall_free_rate is not None else None),
            "learner_cpu_ms_per_token": (
                statistics.median([r.extra["learner_cpu_ms_per_token"] for r in runs])
                if all("learner_cpu_ms_per_token" in r.extra for r in runs) else None),
            "extra": runs[-1].extra}


def e2e_bench(workdir: Path, scale: float, budgets: list[float], tokens: int, rounds: int,
              modes: list[str], warmup: str | None, trace: str = "gptoss20b:eval",
              seed: int = 0, shape: str = "gpt-oss-20b", settings: tuple[str, ...] = (),
              say=print, warmup_label: str | None = None,
              precisions: tuple[str, ...] = ("native",)) -> dict:
    """``warmup``: the flashmoe mode's checkpoint (None: the learner starts cold);
    ``warmup_label``: what the report says of it (default: its own summary);
    ``precisions``: the cache.precision settings of the flashmoe and lru modes (lru skips
    dynamic and random, which need the learned estimate; random draws each load's precision
    with the fractions of loads the same round's dynamic run made)."""
    from flashmoe.tools.store_writer import add_copies
    from flashmoe.tools.synth_store import synth_store

    workdir.mkdir(parents=True, exist_ok=True)
    store = synth_store(workdir / f"store-{shape}-{scale}", shape, scale, show_progress=False)
    if set(precisions) - {"native"}:
        store.close()  # (the copies' writer takes the store's lock)
        written = add_copies(store.path, ["int8", "int4"], show_progress=False)
        if written:
            say(f"[e2e] wrote the store's {', '.join(written)} copies (first use only)")
        store = ExpertStore.open(store.path)
    experts_bytes = sum(e.nbytes for e in store.manifest.experts)
    n_experts = len(store.manifest.experts)
    from common.traces import TraceError, load_trace

    routing = load_trace(trace)
    m = store.manifest
    if (routing.num_layers, routing.num_experts, routing.top_k) != \
            (len(m.moe_layers), m.num_experts, m.top_k):
        raise TraceError(f"trace {trace} routes {routing.num_layers} layers x "
                         f"{routing.num_experts} experts, top-{routing.top_k}; the {shape} store "
                         f"has {len(m.moe_layers)} x {m.num_experts}, top-{m.top_k}")
    skipped = {}
    if "mmap" in modes:
        reason = cgroup_unavailable_reason()
        if reason:
            skipped["mmap"] = reason
            modes = [m for m in modes if m != "mmap"]
    flat = flat_file(store, workdir / f"experts-{shape}-{scale}.bin") \
        if {"mmap", "ram"} & set(modes) else None
    rng = random.Random(seed)
    runs: dict[tuple[str, str, float], list[Run]] = {}
    started = time.perf_counter()
    contenders = [(mode, p) for mode in modes for p in
                  (precisions if mode in ("flashmoe", "lru") else ("native",))
                  if not (mode == "lru" and p in ("dynamic", "random"))]
    for budget in budgets:
        capacity = max(1, int(budget * n_experts))
        budget_bytes = int(budget * experts_bytes)
        for r in range(rounds):
            order = rng.sample(contenders, len(contenders))
            if ("flashmoe", "random") in order and ("flashmoe", "dynamic") in order:
                order.remove(("flashmoe", "random"))  # after dynamic: it takes its fractions
                order.insert(order.index(("flashmoe", "dynamic")) + 1, ("flashmoe", "random"))
            fractions = ""
            for mode, precision in order:
                drop_page_cache()
                if mode in ("flashmoe", "lru"):
                    run = run_system(mode, str(store.path), warmup, trace, tokens, capacity,
                                     workdir, budget, tuple(settings), precision,
                                     fractions if precision == "random" else "")
                    if precision == "dynamic":
                        fractions = ",".join(str(run.extra.get(f"n_load_{p}") or 0)
                                             for p in ("native", "int8", "int4"))
                else:
                    run = run_flat(mode, flat, str(store.path), trace, tokens, budget_bytes,
                                   workdir, budget)
                runs.setdefault((mode, precision, budget), []).append(run)
                say(f"[e2e] budget {budget:g} round {r + 1}/{rounds} {contender_name(mode, precision)}: "
                    f"{tokens / (sum(run.token_ms) / 1e3):.2f} tokens/s, "
                    f"{run.bytes_read / tokens / 1e6:.1f} MB/token")
    results = [summarize(runs[key], tokens) for key in runs]
    return {"shape": shape, "scale": scale, "store_bytes": experts_bytes, "experts": n_experts,
            "expert_bytes": store.manifest.max_expert_bytes, "trace": trace, "tokens": tokens,
            "rounds": rounds, "settings": list(settings), "skipped": skipped,
            "warmup": warmup_label or describe_warmup(warmup), "results": results,
            "wall_s": round(time.perf_counter() - started, 1)}


def format_table(report: dict) -> str:
    head = (f"{'mode':<9} {'precision':<9} {'budget':>6} {'tok/s':>7} {'(min..max)':>14} {'p50 ms':>8} "
            f"{'p99 ms':>8} {'SSD MB/s':>9} {'MB/token':>9} {'PSS GB':>7} {'stall-free':>10} "
            f"{'learner ms':>10}  mix (native/int8/int4)")
    rows = [head, "-" * len(head)]
    for r in report["results"]:
        sf = f"{r['stall_free_rate']:.3f}" if r["stall_free_rate"] is not None else "-"
        cpu = r.get("learner_cpu_ms_per_token")
        cpu = f"{cpu:.2f}" if cpu is not None else "-"
        rows.append(f"{r['mode']:<9} {r.get('precision', 'native'):<9} "
                    f"{r['budget_fraction']:>6g} {r['tokens_per_s']:>7.2f} "
                    f"({r['tokens_per_s_min']:>5.2f}..{r['tokens_per_s_max']:<5.2f}) "
                    f"{r['ms_per_token_p50']:>8.1f} {r['ms_per_token_p99']:>8.1f} "
                    f"{r['ssd_mb_per_s'] or 0:>9.1f} {r['bytes_per_token'] / 1e6:>9.1f} "
                    f"{r['peak_pss_bytes'] / 1e9:>7.2f} {sf:>10} {cpu:>10}  "
                    + "/".join(f"{r.get('precision_mix', {}).get(p, 0):.2f}"
                               for p in ("native", "int8", "int4")))
    for mode, reason in report["skipped"].items():
        rows.append(f"{mode}: skipped ({reason})")
    if "warmup" in report:
        rows.append(f"flashmoe's warm-up: {report['warmup']}")
    rows.append(f"store: {report['shape']} shape at scale {report['scale']} "
                f"({report['store_bytes'] / 1e9:.1f} GB, {report['expert_bytes'] / 1e6:.1f} MB an "
                f"expert); {report['tokens']} tokens of {report['trace']}, {report['rounds']} "
                f"rounds interleaved; wall {report['wall_s']} s")
    return "\n".join(rows)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r["budget_fraction"] for r in report["results"]})
    names = [contender_name(r["mode"], r.get("precision", "native")) for r in report["results"]]
    modes = list(dict.fromkeys(names))
    by = {(name, r["budget_fraction"]): r for name, r in zip(names, report["results"])}
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        xs = [j + i * width for j in range(len(budgets))]
        rows = [by.get((mode, b), {}) for b in budgets]
        ys = [r.get("tokens_per_s", 0) for r in rows]
        # the whisker spans the slowest to the fastest round
        spread = [[y - r.get("tokens_per_s_min", y) for y, r in zip(ys, rows)],
                  [r.get("tokens_per_s_max", y) - y for y, r in zip(ys, rows)]]
        ax.bar(xs, ys, width, yerr=spread, capsize=4, label=mode)
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(budgets))])
    ax.set_xticklabels([f"{b:g} of the experts' bytes" for b in budgets])
    ax.set_ylabel("tokens/s (median; whiskers: min..max of the rounds)")
    ax.set_title(f"end to end, {report['shape']} shape at scale {report['scale']}, "
                 f"{report['tokens']} tokens x {report['rounds']} rounds")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default=".flashmoe/e2e", help="store, expert file, warm-up")
    p.add_argument("--scale", type=float, default=0.21,
                   help="gpt-oss-20b expert size multiplier (0.21: an ~8 GB store)")
    p.add_argument("--shape", default="gpt-oss-20b",
                   help="gpt-oss-20b; qwen3-moe-1.7b (the mmap calibration against llama.cpp, "
                        "with --trace warp:olmoe --modes mmap,ram); gpt-oss-tiny (tests)")
    add_trace(p, help="the routing replayed (its first --tokens decode steps)")
    p.add_argument("--budget", type=csv(float), default=[0.25],
                   help="RAM budget(s) as fractions of all experts' bytes")
    p.add_argument("--tokens", type=int, default=200, help="decode steps of the eval split")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per mode")
    p.add_argument("--modes", type=csv(str), default=["flashmoe", "lru", "mmap", "ram"])
    p.add_argument("--precision", type=csv(str), default=["native"],
                   help="cache.precision settings of the flashmoe and lru modes: native, int8, "
                        "int4, dynamic, random (lru skips dynamic and random); the store "
                        "gets its int8 and int4 copies on first use")
    add_warmup(p, help="the learned policy's warm-up (default: made once from "
                       f"{WARMUP_SPLIT}; none, the learner cold, for a --shape of another "
                       "topology)")
    add_json(p)
    add_plot(p)
    add_set(p, help="a config override for the flashmoe mode (repeatable)")


def describe_warmup(folder: str | None) -> str:
    """A warm-up checkpoint as the report names it: what it was made from, not where it is."""
    if folder is None:
        return "none (cold)"
    try:
        made = json.loads((Path(folder) / "predictor.json").read_text())["warmup"]
        return f"{made['trace']}, {made['passes']} pass(es) over {made['tokens']} tokens"
    except (OSError, ValueError, KeyError, TypeError):
        return "a checkpoint without a warm-up summary"


def choose_warmup(args: argparse.Namespace, workdir: Path) -> tuple[str | None, str | None]:
    """The flashmoe mode's warm-up checkpoint and what the report says of it. --warmup must
    fit the store's shape (else CheckpointError). The default is made once from
    ``WARMUP_SPLIT``; where that split routes another topology than ``--shape`` (another
    model's shape), the learner starts cold, as it would on a model never seen."""
    from common.config import load_config
    from common.model_families import SYNTH_SHAPES
    from flashmoe.errors import CheckpointError
    from flashmoe.sim.learning import warmup as run_warmup
    from flashmoe.sim.learning import warmup_fits

    if args.shape not in SYNTH_SHAPES:
        return args.warmup, None  # synth_store names the choices
    shape = SYNTH_SHAPES[args.shape]
    topology = (shape.layers, shape.experts)
    config = load_config(env={}, overrides=list(args.set))  # as the flashmoe mode runs
    if args.warmup is not None:
        if not warmup_fits(args.warmup, config, topology):
            raise CheckpointError(
                f"{args.warmup}: not a warm-up checkpoint for this predictor and the "
                f"{args.shape} shape ({shape.layers} layers x {shape.experts} experts); make one "
                f"with `flashmoe warmup --trace <a trace of that shape> --out DIR` (--passes 0: "
                f"a cold one), or leave --warmup out")
        return args.warmup, None
    folder = workdir / "warmup"
    if warmup_fits(folder, config, topology):
        return str(folder), None
    split = trace_of(args, WARMUP_SPLIT)
    if (split.num_layers, split.num_experts) != topology:
        label = f"none (cold: the default warm-up, {WARMUP_SPLIT}, is of another shape)"
        print(f"[e2e] the learned policy starts cold: {WARMUP_SPLIT} routes {split.num_layers} "
              f"layers x {split.num_experts} experts, the {args.shape} shape has "
              f"{shape.layers} x {shape.experts}")
        return None, label
    print("[e2e] warming the learned policy up on the train split (first use only)")
    run_warmup(split, config, folder)
    return str(folder), None


def run(args: argparse.Namespace) -> int:
    from flashmoe.errors import UsageError

    known = ("native", "int8", "int4", "dynamic", "random")
    for p in args.precision:
        if p not in known:
            raise UsageError(f"--precision {p}: one of {', '.join(known)}")
    workdir = Path(args.workdir)
    warmup, label = args.warmup, None
    if "flashmoe" in args.modes:
        warmup, label = choose_warmup(args, workdir)
    report = e2e_bench(workdir, args.scale, args.budget, args.tokens, args.rounds, args.modes,
                       warmup, trace=args.trace, shape=args.shape, settings=args.set,
                       warmup_label=label, precisions=tuple(args.precision))
    print(format_table(report))
    save(args, report, plot)
    return 0
