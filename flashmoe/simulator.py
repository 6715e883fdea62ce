"""Trace replay: the cache manager's own policy classes on a routing trace (`flashmoe bench`).

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
import multiprocessing as mp
import os
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from common.traces import Trace, TraceError
from flashmoe.device_model import DeviceModel, ModelShape, describe, token_time_ms
from services.cache_manager.policies import POLICIES, PolicyError, make_policy, needs_future
from services.cache_manager.policies.belady import NEVER


@dataclass
class Requests:
    keys: np.ndarray  # int64 key per request, in replay order
    starts: np.ndarray  # cache lifetimes: requests starts[i]:starts[i+1] share one fresh cache
    token_layer: np.ndarray  # token * layers + layer of each request, in replay order
    n_tokens: int
    n_layers: int


def build_requests(trace: Trace, scope: str) -> Requests:
    T, L, K = trace.experts.shape
    E = trace.num_experts
    if scope == "global":
        keys = (trace.experts.astype(np.int64) + (np.arange(L, dtype=np.int64) * E)[None, :, None])
        return Requests(keys.reshape(-1), np.array([0, T * L * K], dtype=np.int64),
                        np.repeat(np.arange(T * L, dtype=np.int64), K), T, L)
    if scope != "layer":
        raise ValueError(f"scope must be global or layer, got {scope!r}")
    seq_of_token = np.repeat(np.arange(trace.n_sequences), np.diff(trace.offsets))
    flat = np.arange(T * L * K, dtype=np.int64)
    token, layer = flat // (L * K), (flat // K) % L
    # Sequence-major, then layer, then token order, then the row's own order (stable sort).
    segment = seq_of_token[token] * L + layer
    order = np.argsort(segment, kind="stable")
    seg_sorted = segment[order]
    starts = np.concatenate([[0], np.flatnonzero(np.diff(seg_sorted)) + 1, [len(order)]])
    return Requests(trace.experts.reshape(-1).astype(np.int64)[order], starts.astype(np.int64),
                    order // K, T, L)


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
    """Hit (True) or miss of every request, in replay order."""
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


# Worker processes inherit the requests through fork instead of pickling 7.6 M keys per job.
_SHARED: dict = {}


def _run_job(job: tuple[str, int]) -> tuple[str, int, np.ndarray, float]:
    policy, capacity = job
    started = time.perf_counter()
    hits = replay(policy, capacity, _SHARED["requests"], _SHARED.get("next_use"))
    return policy, capacity, np.packbits(hits), time.perf_counter() - started


def capacity_for(fraction: float, trace: Trace, scope: str) -> int:
    experts = trace.num_experts * (trace.num_layers if scope == "global" else 1)
    capacity = int(fraction * experts)
    if capacity < 1 or fraction > 1:
        raise TraceError(f"capacity fraction {fraction} of {experts} experts gives {capacity}; "
                         f"use a fraction in (0, 1] that leaves at least one expert")
    return capacity


def run_bench(trace: Trace, scope: str, fractions: list[float], policies: list[str],
              device: DeviceModel, shape: ModelShape, jobs: int | None = None,
              progress: bool = True) -> dict:
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise PolicyError(f"unknown policies {unknown}; registered: {', '.join(POLICIES)}")
    capacities = {f: capacity_for(f, trace, scope) for f in fractions}  # fail before any work
    started = time.perf_counter()
    requests = build_requests(trace, scope)
    _SHARED["requests"] = requests
    if any(needs_future(p) for p in policies):
        _SHARED["next_use"] = next_use_positions(requests)
    work = [(p, capacities[f]) for f in fractions for p in policies]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    hits_of: dict[tuple[str, int], np.ndarray] = {}
    seconds: dict[tuple[str, int], float] = {}
    pool = mp.get_context("fork").Pool(jobs) if jobs > 1 else None
    with pool or contextlib.nullcontext(), tqdm(total=len(work), unit="run",
                                                desc=f"bench {trace.name} {scope}",
                                                disable=not progress) as bar:
        runs = pool.imap_unordered(_run_job, work) if pool else map(_run_job, work)
        for policy, capacity, packed, secs in runs:
            hits_of[(policy, capacity)] = packed
            seconds[(policy, capacity)] = secs
            bar.update()
    _SHARED.clear()

    n = len(requests.keys)
    results = []
    for fraction in fractions:
        capacity = capacities[fraction]
        hits = {p: np.unpackbits(hits_of[(p, capacity)], count=n).astype(bool) for p in policies}
        counts = {p: int(h.sum()) for p, h in hits.items()}
        for policy in policies:
            misses = np.bincount(requests.token_layer[~hits[policy]],
                                 minlength=requests.n_tokens * requests.n_layers)
            total_ms = float(token_time_ms(misses, device, shape).sum())
            ssd_bytes = int((n - counts[policy]) * shape.expert_bytes)
            gap = None
            if "lru" in counts and "belady" in counts and counts["belady"] != counts["lru"]:
                gap = round((counts[policy] - counts["lru"]) / (counts["belady"] - counts["lru"]), 4)
            resident = capacity * (requests.n_layers if scope == "layer" else 1)
            results.append({
                "policy": policy, "scope": scope, "capacity": capacity,
                "capacity_fraction": fraction, "accesses": n, "hits": counts[policy],
                "hit_rate": round(counts[policy] / n, 6), "ssd_bytes": ssd_bytes,
                "gap_closed": gap, "ms_per_token": round(total_ms / requests.n_tokens, 3),
                "ssd_mb_per_s": round(ssd_bytes / (total_ms / 1e3) / 1e6, 1),
                "cache_bytes": resident * shape.expert_bytes,
                "replay_s": round(seconds[(policy, capacity)], 2)})
    return {"trace": trace.name, "scope": scope, "tokens": requests.n_tokens,
            "sequences": trace.n_sequences, "accesses": n, "assumptions": describe(device, shape),
            "jobs": jobs, "wall_s": round(time.perf_counter() - started, 1), "results": results}


def format_table(report: dict) -> str:
    head = (f"{'policy':<8} {'cap':>5} {'frac':>7} {'hits':>10} {'hit rate':>8} {'SSD GB':>9} "
            f"{'gap':>7} {'ms/tok':>8} {'SSD MB/s':>9} {'cache GB':>8}")
    rows = [head, "-" * len(head)]
    last_fraction = None
    for r in report["results"]:
        if last_fraction is not None and r["capacity_fraction"] != last_fraction:
            rows.append("")
        last_fraction = r["capacity_fraction"]
        gap = f"{r['gap_closed']:7.3f}" if r["gap_closed"] is not None else f"{'-':>7}"
        rows.append(f"{r['policy']:<8} {r['capacity']:>5} {r['capacity_fraction']:>7.4f} "
                    f"{r['hits']:>10} {r['hit_rate']:>8.4f} {r['ssd_bytes'] / 1e9:>9.1f} {gap} "
                    f"{r['ms_per_token']:>8.2f} {r['ssd_mb_per_s']:>9.1f} "
                    f"{r['cache_bytes'] / 1e9:>8.2f}")
    a = report["assumptions"]
    rows.append("")
    rows.append(f"{report['trace']}, scope {report['scope']}: {report['sequences']} sequences, "
                f"{report['tokens']} tokens, {report['accesses']} accesses; "
                f"wall {report['wall_s']} s on {report['jobs']} processes")
    rows.append(f"device model {a['device']['name']} ({a['device']['description']}): SSD "
                f"{a['device']['ssd_bytes_per_s'] / 1e9:.2f} GB/s + {a['device']['ssd_latency_ms']}"
                f" ms per batch of reads, compute {a['compute_ms_per_layer']:.3f} ms/layer; "
                f"expert {a['model']['expert_bytes'] / 1e6:.2f} MB ({a['model']['name']}); "
                f"demand fetching, no prefetch")
    return "\n".join(rows)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in report["results"]):
        rows = [r for r in report["results"] if r["policy"] == policy]
        ax.plot([r["capacity_fraction"] for r in rows], [r["hit_rate"] for r in rows],
                marker="o", label=policy, linestyle="--" if policy == "belady" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache capacity (fraction of experts" +
                  (" per layer)" if report["scope"] == "layer" else ")"))
    ax.set_ylabel("hit rate")
    ax.set_title(f"{report['trace']}, {report['scope']} scope, {report['accesses']:,} accesses")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
