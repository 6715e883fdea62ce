"""Trace replay (`flashmoe bench`): the cache manager's own code on a routing trace.

Two modes:
  - ``core`` (the default): the live cache manager's decision core (``CacheManagerCore``:
    ``(layer, expert)`` keys, per-layer pins, LOADING states, prefetch accounting) driven by
    the inference worker's own acquire schedule on a virtual clock. Reads complete when the
    device model's disk says so (one SSD channel shared by every read), each layer computes
    for the device model's compute time once its experts are resident; a layer that waits
    for a read is a stall. Its hit and miss counts are what the live manager gives on the
    same trace slice (a test checks that).
  - ``requests``: the plain per-request replay of the policy objects (``policy.request``,
    int keys, no pins), the protocol libCacheSim implements; kept for the cross-check.

Request model (``../shared/traces/README.md``): every (token, layer, expert) selection is one
request, token-major then layer-major, a row's experts in stored order.
  - ``global``: one cache over all (layer, expert) pairs, warm across the whole trace; the
    capacity is a fraction of all experts, rounded down.
  - ``layer``: one cache per layer, cold at each sequence start; the capacity is a fraction of
    one layer's experts, rounded down (experts per layer).
Belady's MIN is fed each request's next-use position (within the same cache's lifetime).
(policy, capacity) jobs run in parallel worker processes.
"""

from __future__ import annotations

import contextlib
import heapq
from pathlib import Path
import itertools
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from common.arena import pool_fractions
from common.config import FlashMoEConfig, precision_split
from common.quant import PRECISIONS
from common.traces import Trace, TraceError
from flashmoe.sim.device_model import DeviceModel, ModelShape, SimulatedSSD, describe, token_time_ms
from flashmoe.sim.hooks import SIM_WORKER, ReplayHooks
from services.cache_manager.core import AcquireFailed, CacheManagerCore
from services.cache_manager.policies import (POLICIES, PolicyError, make_policy, needs_core,
                                             needs_future)
from services.cache_manager.policies.belady import NEVER
from services.inference_worker.core import acquire_schedule

MODES = ("core", "requests")


@dataclass
class Requests:
    keys: np.ndarray  # int64 key per request, in replay order
    starts: np.ndarray  # cache lifetimes: requests starts[i]:starts[i+1] share one fresh cache
    token_layer: np.ndarray  # token * layers + layer of each request, in replay order
    n_tokens: int
    n_layers: int


def build_requests(trace: Trace, scope: str, order: str = "replay") -> Requests:
    """Every request as an int key (layer * experts + expert). ``order="replay"``: the
    per-request replay's order (layer scope: sequence, layer, token); ``order="token"``:
    token-major always (the core mode's order, cache lifetimes at sequence starts in the
    layer scope)."""
    T, L, K = trace.experts.shape
    E = trace.num_experts
    if scope not in ("global", "layer"):
        raise ValueError(f"scope must be global or layer, got {scope!r}")
    keys = (trace.experts.astype(np.int64) + (np.arange(L, dtype=np.int64) * E)[None, :, None])
    token_layer = np.repeat(np.arange(T * L, dtype=np.int64), K)
    if scope == "global":
        return Requests(keys.reshape(-1), np.array([0, T * L * K], dtype=np.int64),
                        token_layer, T, L)
    if order == "token":
        return Requests(keys.reshape(-1), (trace.offsets * L * K).astype(np.int64),
                        token_layer, T, L)
    seq_of_token = np.repeat(np.arange(trace.n_sequences), np.diff(trace.offsets))
    flat = np.arange(T * L * K, dtype=np.int64)
    token, layer = flat // (L * K), (flat // K) % L
    # Sequence-major, then layer, then token order, then the row's own order (stable sort).
    segment = seq_of_token[token] * L + layer
    order_ = np.argsort(segment, kind="stable")
    seg_sorted = segment[order_]
    starts = np.concatenate([[0], np.flatnonzero(np.diff(seg_sorted)) + 1, [len(order_)]])
    return Requests(trace.experts.reshape(-1).astype(np.int64)[order_], starts.astype(np.int64),
                    order_ // K, T, L)


def next_use_positions(requests: Requests) -> np.ndarray:
    """Index of the next request of the same key within the same cache lifetime, or NEVER."""
    keys, starts = requests.keys, requests.starts
    n = len(keys)
    segment = np.repeat(np.arange(len(starts) - 1, dtype=np.int64), np.diff(starts))
    combined = segment * (int(keys.max()) + 1 if n else 1) + keys
    order = np.argsort(combined, kind="stable")
    nxt = np.full(n, NEVER, dtype=np.int64)
    same = combined[order[1:]] == combined[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def replay(policy: str, capacity: int, requests: Requests, next_use: np.ndarray | None = None,
           params: dict | None = None) -> np.ndarray:
    """``requests`` mode: hit (True) or miss of every request, in replay order."""
    keys = requests.keys.tolist()
    starts = requests.starts.tolist()
    oracle = needs_future(policy)
    if oracle and next_use is None:
        next_use = next_use_positions(requests)
    nus = next_use.tolist() if oracle else None
    out: list[bool] = []
    for a, b in zip(starts[:-1], starts[1:]):
        cache = make_policy(policy, capacity, params)
        request = cache.request
        if oracle:
            set_next_use = cache.set_next_use
            out.extend([set_next_use(t) or request(k) for k, t in zip(keys[a:b], nus[a:b])])
        else:
            out.extend(map(request, keys[a:b]))
    return np.fromiter(out, dtype=bool, count=len(keys))


@dataclass
class CoreRun:
    hits: np.ndarray  # hits of each (token, layer) step, token-major (int8)
    stats: dict  # the core's counters, summed over its lifetimes
    total_ms: float  # virtual time of the whole replay
    stall_ms: float  # of which layers waited for reads
    mix: dict = field(default_factory=dict)  # precision -> router weight of its computations


# A precision copy's bytes as a fraction of a bf16 expert's (common/quant.py: int8 a byte a
# weight, per-row scales; int4 half a byte plus a float16 scale per 32 weights).
COPY_RATIO = {"int8": 0.5, "int4": (4 + 16 / 32) / 16}


def sim_layout(capacity: int, expert_bytes: int, precision: str, split=None):
    """The arena's layout for ``precision`` at the device model's expert size."""
    from common.arena import plan_pools
    from common.store import ALIGN, round_up

    sizes = {"native": round_up(max(expert_bytes, 1), ALIGN),
             **{p: round_up(max(int(expert_bytes * r), 1), ALIGN)
                for p, r in COPY_RATIO.items()}}
    return plan_pools(sizes, capacity, precision, split)


def replay_core(policy: str, capacity: int, trace: Trace, scope: str, device: DeviceModel,
                expert_bytes: int, compute_ms: float, next_use: np.ndarray | None = None,
                params: dict | None = None, hooks: ReplayHooks | None = None,
                prefetch_budget: int = 0, prefetch_window: int | None = None,
                precision: str = "native", fractions: tuple[float, ...] | None = None,
                admit: float = 1.0, upgrades: int = 0, layout=None,
                weight_power: float = 0.0, split: tuple[float, ...] | None = None
                ) -> CoreRun:
    """``core`` mode: the cache manager's core on a virtual clock, driven by the worker's
    acquire schedule. ``next_use``: per request in token-major order (oracle policies).
    Prefetch loads (``hooks`` hinting, within ``prefetch_budget``) share the SSD with demand
    reads; one is started when the disk has less than one expert's transfer left queued
    (the free queue depth). ``precision``: cache.precision (``sim_layout`` with the pools'
    byte ``split``, cache.precision_split; ``fractions``:
    random's; ``layout``: the arena's ``ArenaLayout``, a live store's, instead of the
    device model's; ``weight_power``: cache.precision_weight, by the trace's router
    probabilities); the run's ``mix`` is the router weight computed at each precision."""
    L, E = trace.num_layers, trace.num_experts
    sizes = {(layer, expert): expert_bytes for layer in range(L) for expert in range(E)}
    n_slots = capacity * (L if scope == "layer" else 1)
    pools = pool_bytes = None
    if precision != "native":
        layout = layout or sim_layout(capacity, expert_bytes, precision, split)
        n_slots = layout.n_units
        pools = [(p.precision, list(p.slots())) for p in layout.pools]
        pool_bytes = {p: int(expert_bytes * r) for p, r in COPY_RATIO.items()}
        if len(pools) > 1:
            fractions = pool_fractions(layout, fractions)
    mix: dict[str, float] = {}
    probs = trace.probs
    # One cache for the whole trace (global), or a fresh one per sequence (layer scope).
    bounds = trace.offsets.tolist() if scope == "layer" else [0, trace.n_tokens]
    hits = np.zeros(trace.n_tokens * L, dtype=np.int8)
    totals: dict = {}
    ssd = SimulatedSSD(device)
    transfer_ms = expert_bytes * ssd.ms_per_byte
    tie = itertools.count()
    now = stall = 0.0
    K = trace.top_k
    hooks = hooks or ReplayHooks()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        core = CacheManagerCore(sizes, n_slots, policy, params, scope=scope, allow_oracle=True,
                                prefetch_budget=prefetch_budget, prefetch_window=prefetch_window,
                                pools=pools, pool_bytes=pool_bytes, precision=precision,
                                fractions=fractions, admit=admit,
                                upgrades_per_token=upgrades, weight_power=weight_power)
        if next_use is not None:
            future = next_use[start * L * K:stop * L * K]
            if scope == "layer":  # each layer's cache sees its own layer's requests only
                future = future.reshape(-1, L, K)
                for layer, p in core.policies.items():
                    p.feed(future[:, layer].reshape(-1).tolist())
            else:
                core.policies[None].feed(future.tolist())
        hooks.start(core)
        acquire, finish, stats = core.acquire, core.finish_load, core.stats
        hooked = type(hooks) is not ReplayHooks  # the plain replay skips the no-op calls
        heap: list = []
        step = start * L
        token = start
        for offset, layer, experts, release in acquire_schedule(trace.experts[start:stop]):
            while heap and heap[0][0] <= now:
                finish(heapq.heappop(heap)[2], True)
            token = start + offset
            if hooked:
                hooks.before_request(core, now, token, layer)
            before = stats["n_hit"]
            weights = probs[token, layer].tolist() if pools is not None and \
                probs is not None else None
            _slots, loads, waiter = acquire(SIM_WORKER, layer, experts, release, step=token,
                                            weights=weights)
            if pools is not None:
                for slot, weight in zip(_slots, weights or [1.0] * len(experts)):
                    name = core.precision_of(slot)
                    mix[name] = mix.get(name, 0.0) + float(weight)
            if loads and not heap:
                # Nothing else in flight: this request's reads complete in issue order, and
                # it waits for the last one.
                done_at = now
                for load in loads:
                    done_at = ssd.read(now, load.nbytes)
                    finish(load.key, True)
                stall += done_at - now
                now = done_at
            else:
                for load in loads:
                    heapq.heappush(heap, (ssd.read(now, load.nbytes), next(tie), load.key))
                while waiter is not None and waiter.missing:
                    done_at, _, key = heapq.heappop(heap)
                    finish(key, True)
                    if done_at > now:
                        stall += done_at - now
                        now = done_at
            hits[step] = stats["n_hit"] - before
            step += 1
            if hooked:
                hooks.after_request(core, now, token, layer, experts)
            if (core.pending_hints or core.may_upgrade()) and ssd.free_at - now < transfer_ms:
                for load in core.issue_prefetches(1):
                    heapq.heappush(heap, (ssd.read(now, load.nbytes), next(tie), load.key))
            now += compute_ms
            if hooked and layer == L - 1:
                hooks.after_token(token, now)
        while heap:
            finish(heapq.heappop(heap)[2], True)
        for name, value in stats.items():
            totals[name] = totals.get(name, 0) + value
    total = sum(mix.values())
    return CoreRun(hits, totals, now, stall,
                   {p: w / total for p, w in sorted(mix.items())} if total else {})


# Worker processes inherit the trace through fork instead of pickling it per job.
_SHARED: dict = {}


def _run_job(job: tuple) -> tuple[tuple, dict, float]:
    policy, capacity, precision, fractions = job
    started = time.perf_counter()
    if _SHARED["mode"] == "core":
        metrics = _core_job(policy, capacity, precision, fractions)
    else:
        metrics = _requests_job(policy, capacity)
    return job[:3], metrics, time.perf_counter() - started


def _requests_job(policy: str, capacity: int) -> dict:
    requests, shape, device = _SHARED["requests"], _SHARED["shape"], _SHARED["device"]
    hits = replay(policy, capacity, requests, _SHARED.get("next_use"))
    n_hits = int(hits.sum())
    out = {"hits": n_hits, "loads": len(hits) - n_hits}
    if shape is not None:
        misses = np.bincount(requests.token_layer[~hits],
                             minlength=requests.n_tokens * requests.n_layers)
        out["total_ms"] = float(token_time_ms(misses, device, shape).sum())
    return out


def _core_job(policy: str, capacity: int, precision: str = "native",
              fractions: tuple[float, ...] | None = None) -> dict:
    trace, scope, shape, device = (_SHARED[k] for k in ("trace", "scope", "shape", "device"))
    config = _SHARED["config"]
    options = _SHARED["options"]
    hooks, learning = _hooks_for(policy, trace, config, options)
    prefetch = options.get("prefetch", False)
    try:
        run = replay_core(policy, capacity, trace, scope, device,
                          shape.expert_bytes if shape else 0,
                          device.compute_ms_per_layer(shape) if shape else 0.0,
                          _SHARED.get("next_use") if needs_future(policy) else None,
                          params=config.cache.policy_params if policy == config.cache.policy
                          else None, hooks=hooks,
                          prefetch_budget=config.prefetch.budget if prefetch else 0,
                          prefetch_window=config.prefetch.window if prefetch else None,
                          precision=precision, fractions=fractions,
                          admit=config.cache.precision_admit,
                          upgrades=config.cache.precision_upgrades,
                          weight_power=config.cache.precision_weight,
                          split=precision_split(config.cache))
    except AcquireFailed as exc:
        return {"infeasible": str(exc)}
    stats = run.stats
    out = {"hits": stats["n_hit"], "loads": stats["n_load"],
           "n_hit_loading": stats["n_hit_loading"], "mix": run.mix,
           "bytes_loaded": stats["n_byte_loaded"],
           "loads_by_precision": {p: stats.get(f"n_load_{p}", 0)
                                  for p in PRECISIONS}}
    if prefetch:
        out.update({k: stats[k] for k in ("prefetch_issued", "prefetch_used", "prefetch_wasted",
                                          "prefetch_bytes", "prefetch_learned")})
    if learning is not None:
        out["cpu_ms_per_token"] = round(learning.cpu_ms_per_token(), 3)
        out["cpu_ms_by_stage"] = {k: round(1e3 * v / max(learning.tokens, 1), 3)
                                  for k, v in {**learning.cpu_s,
                                               **learning.learner.cpu_s}.items()}
        out["drifts"] = len(learning.learner.drifts)
        out["variance_kept"] = learning.extractor.pca.variance_kept
        out["estimates"] = hooks.published
    if shape is not None:
        out["total_ms"], out["stall_ms"] = run.total_ms, run.stall_ms
    return out


def _hooks_for(policy: str, trace: Trace, config, options: dict):
    """The learning path (for a policy that takes estimates) and the inline prefetcher (with
    ``--prefetch``, unless ``prefetch.inline`` is off, as in the cache manager), or (None,
    None)."""
    from flashmoe.sim.learning import Learning, LearningPath
    from services.cache_manager.policies import POLICIES
    from services.cache_manager.prefetcher import NextLayerPrefetcher, PrefetcherParams

    learning = None
    if getattr(POLICIES[policy], "accepts_estimates", False):
        learning = Learning.create(trace.num_layers, trace.num_experts, trace.top_k, config)
        if options.get("warmup"):
            learning.load(options["warmup"])
    prefetcher = None
    if options.get("prefetch") and config.prefetch.inline and not needs_future(policy):
        prefetcher = NextLayerPrefetcher(trace.num_layers, trace.num_experts, trace.top_k,
                                         PrefetcherParams(threshold=config.prefetch.threshold))
    if learning is None and prefetcher is None:
        return None, None
    pf = config.prefetch
    learned = (pf.learned, pf.learned_margin, pf.learned_ratio, pf.learned_skip) \
        if options.get("prefetch") and learning is not None else None
    return LearningPath(trace, learning, config.predictor.publish_interval_ms,
                        options.get("stale_tokens", 0), prefetcher, learned,
                        pf.inline_with_learned), learning


def capacity_for(fraction: float, trace: Trace, scope: str) -> int:
    experts = trace.num_experts * (trace.num_layers if scope == "global" else 1)
    capacity = int(fraction * experts)
    if capacity < 1 or fraction > 1:
        raise TraceError(f"capacity fraction {fraction} of {experts} experts gives {capacity}; "
                         f"use a fraction in (0, 1] that leaves at least one expert")
    return capacity


def show_progress(progress: bool | None) -> bool:
    """Progress bars only on a terminal unless asked for explicitly."""
    return sys.stderr.isatty() if progress is None else progress


def run_bench(trace: Trace, scope: str, fractions: list[float], policies: list[str],
              device: DeviceModel, shape: ModelShape | None, mode: str = "core",
              jobs: int | None = None, progress: bool | None = None,
              config: FlashMoEConfig | None = None, warmup: str | None = None,
              prefetch: bool = False, stale_tokens: int = 0,
              precisions: tuple[str, ...] = ("native",)) -> dict:
    """``shape`` None: a model without a shape profile; hit rates only, the time and byte
    columns are null. ``config``: predictor, feature and prefetch settings (and
    ``cache.policy_params`` for the policy ``cache.policy`` names). ``warmup``: a checkpoint
    of `flashmoe warmup` for the learned policy; ``prefetch``: the inline prefetcher on for
    every policy but Belady (which stays the demand-fetching bound). ``precisions``:
    cache.precision settings (``sim_layout``); dynamic and random run only for the policies
    that take the learned estimate, random after dynamic with the fractions of its loads."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise PolicyError(f"unknown policies {unknown}; registered: {', '.join(POLICIES)}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    layer_aware = [p for p in policies if needs_core(p)]
    if mode == "requests" and layer_aware:
        raise PolicyError(f"{', '.join(layer_aware)}: follows the layer order through the cache "
                          f"manager's core; run them with --mode core")
    capacities = {f: capacity_for(f, trace, scope) for f in fractions}  # fail before any work
    started = time.perf_counter()
    if (prefetch or stale_tokens or warmup) and mode != "core":
        raise PolicyError("--prefetch, --warmup and stale predictions need --mode core")
    _SHARED.update(mode=mode, trace=trace, scope=scope, shape=shape, device=device,
                   config=config or FlashMoEConfig(),
                   options={"warmup": warmup, "prefetch": prefetch,
                            "stale_tokens": stale_tokens})
    requests = build_requests(trace, scope, order="token" if mode == "core" else "replay")
    _SHARED["requests"] = requests
    if any(needs_future(p) for p in policies):
        _SHARED["next_use"] = next_use_positions(requests)
    # The slowest runs first (the learned policy, then the scored ones, whose victims are
    # ranked), so that the pool's processes finish together.
    cost = {**{p: 1 for p in policies if needs_core(p)}, "flashmoe": 0}
    learned = {p for p in policies if getattr(POLICIES[p], "accepts_estimates", False)}
    combos = [(p, c) for c in precisions for p in policies
              if c in ("native", "int8", "int4") or p in learned]
    if mode != "core" and set(precisions) != {"native"}:
        raise PolicyError("--precision needs --mode core")
    precision_split(_SHARED["config"].cache)  # a malformed split fails before any work
    first = [(p, capacities[f], c, None) for f in fractions for p, c in combos if c != "random"]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(first) or 1))
    metrics: dict[tuple, dict] = {}
    seconds: dict[tuple, float] = {}

    def random_work() -> list[tuple]:
        """random's jobs, each with the fractions of the loads its dynamic run made."""
        work = []
        for f in fractions:
            for p, c in combos:
                share = metrics.get((p, capacities[f], "dynamic"), {}).get("loads_by_precision")
                if c == "random":
                    work.append((p, capacities[f], c, tuple(
                        float(share[x]) for x in PRECISIONS)
                        if share and sum(share.values()) else None))
        return work

    pool = mp.get_context("fork").Pool(jobs) if jobs > 1 else None
    with pool or contextlib.nullcontext(), tqdm(total=len(combos) * len(fractions), unit="run",
                                                desc=f"bench {trace.name} {scope} {mode}",
                                                disable=not show_progress(progress)) as bar:
        for phase in (lambda: first, random_work):  # random's once dynamic's are in
            work = sorted(phase(), key=lambda job: cost.get(job[0], 2))
            runs = pool.imap_unordered(_run_job, work) if pool else map(_run_job, work)
            for key, result, secs in runs:
                metrics[key] = result
                seconds[key] = secs
                bar.update()
    _SHARED.clear()

    n = len(requests.keys)
    results = []
    for fraction in fractions:
        capacity = capacities[fraction]
        counts = {p: metrics[(p, capacity, "native")].get("hits") for p in policies
                  if (p, capacity, "native") in metrics}
        for policy, precision in combos:
            m = metrics[(policy, capacity, precision)]
            resident = capacity * (requests.n_layers if scope == "layer" else 1)
            row = {"policy": policy, "precision": precision, "precision_mix": m.get("mix") or
                   {precision: 1.0}, "scope": scope, "mode": mode, "capacity": capacity,
                   "capacity_fraction": fraction, "accesses": n, "hits": m.get("hits"),
                   "hit_rate": None, "ssd_bytes": None, "gap_closed": None,
                   "ms_per_token": None, "ssd_mb_per_s": None, "cache_bytes": None,
                   "replay_s": round(seconds[(policy, capacity, precision)], 2)}
            if "infeasible" in m:
                row["infeasible"] = m["infeasible"]
                results.append(row)
                continue
            row["hit_rate"] = round(m["hits"] / n, 6)
            if mode == "core":
                row["n_hit_loading"] = m["n_hit_loading"]
            if "prefetch_issued" in m:
                # resident when requested, prefetches that landed in time included
                row["stall_free_rate"] = row["hit_rate"]
                row.update({k: m[k] for k in ("prefetch_issued", "prefetch_learned",
                                              "prefetch_used", "prefetch_wasted",
                                              "prefetch_bytes")})
            for key in ("cpu_ms_per_token", "cpu_ms_by_stage", "drifts", "variance_kept",
                        "estimates"):
                if key in m:
                    row[key] = m[key]
            lru, belady = counts.get("lru"), counts.get("belady")
            if lru is not None and belady is not None and belady != lru \
                    and precision == "native":
                row["gap_closed"] = round((m["hits"] - lru) / (belady - lru), 4)
            if shape is not None:
                ssd_bytes = int(m["loads"] * shape.expert_bytes) if precision == "native" \
                    else int(m["bytes_loaded"])
                row.update(ssd_bytes=ssd_bytes,
                           ms_per_token=round(m["total_ms"] / requests.n_tokens, 3),
                           ssd_mb_per_s=round(ssd_bytes / (m["total_ms"] / 1e3) / 1e6, 1),
                           cache_bytes=resident * shape.expert_bytes)
                if "stall_ms" in m:
                    row["stall_ms_per_token"] = round(m["stall_ms"] / requests.n_tokens, 3)
            results.append(row)
    return {"trace": trace.name, "scope": scope, "mode": mode, "prefetch": prefetch,
            "warmup": Path(warmup).name if warmup else None, "stale_tokens": stale_tokens,
            "tokens": requests.n_tokens,
            "sequences": trace.n_sequences, "accesses": n,
            "assumptions": describe(device, shape) if shape is not None else None,
            "precisions": list(precisions), "jobs": jobs,
            "wall_s": round(time.perf_counter() - started, 1), "results": results}
