"""`flashmoe io-bench`: read every expert of a store in random order through an IO engine and
compare with the device ceiling that fio measures on the same stripe files.

Per (engine, depth) it reports MB/s, p50/p99 per-expert read latency (first block submitted ->
last block completed, under the benchmark's load), the fio ceiling at the same block size and
queue depth, and their ratio. Each figure is the median of ``repeat`` interleaved passes.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass

import numpy as np

from common.arena import Arena
from common.store import ExpertStore
from services.cache_manager.io_engine import open_engine


@dataclass
class IOBenchResult:
    engine: str
    block_size: int
    depth: int
    mb_per_s: float
    p50_us: float
    p99_us: float
    ceiling_mb_per_s: float | None
    ratio: float | None
    bytes_read: int
    experts: int


def drop_page_cache() -> bool:
    """Drop the page cache where permitted (root); O_DIRECT reads bypass it anyway."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def fio_ceiling(store: ExpertStore, depth: int, io_bytes: int) -> float | None:
    """fio randread MB/s over the stripe files at the store's block size and ``depth``."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    files = ":".join(str(p).replace(":", "\\:") for p in store.stripe_paths)
    bs = store.manifest.block_size
    cmd = [fio, "--name=ceiling", f"--filename={files}", "--rw=randread", f"--bs={bs}",
           f"--iodepth={depth}", "--direct=1", "--ioengine=io_uring",
           f"--io_size={io_bytes}", "--output-format=json", "--randrepeat=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed: {' '.join(cmd)}\n{proc.stderr.strip()}")
    fio_json = json.loads(proc.stdout[proc.stdout.index("{"):])
    return fio_json["jobs"][0]["read"]["bw_bytes"] / 1e6


def run_pass(store: ExpertStore, engine, n_slots: int, rng: np.random.Generator):
    keys = store.keys()
    order = rng.permutation(len(keys))
    per_expert = [store.read_ops(*keys[k], slot=i % n_slots) for i, k in enumerate(order)]
    bounds = np.cumsum([0] + [len(ops) for ops in per_expert])
    ops = np.concatenate(per_expert)
    drop_page_cache()
    start = time.perf_counter()
    engine.read(ops)
    elapsed = time.perf_counter() - start
    bad = ops["result"] != ops["length"]
    if bad.any():
        first = ops[bad][0]
        raise RuntimeError(f"read of stripe {first['file_index']} offset {first['file_offset']} "
                           f"returned {first['result']}")
    latencies = [(int(ops["t_complete_ns"][a:b].max()) - int(ops["t_submit_ns"][a:b].min())) / 1e3
                 for a, b in zip(bounds[:-1], bounds[1:])]
    nbytes = int(ops["length"].sum())
    return nbytes / elapsed / 1e6, latencies, nbytes


def io_bench(store_path: str, engines: list[str], depths: list[int], repeat: int = 5,
             seed: int = 0, with_fio: bool = True) -> list[IOBenchResult]:
    """Per depth, ``repeat`` rounds in which fio and each engine run once, in a fresh random
    order per round, so that a shared disk's drifting speed hits every contender alike; figures
    are per-contender medians."""
    store = ExpertStore.open(store_path)
    rng = np.random.default_rng(seed)
    total = sum(int(store.read_ops(*k, slot=0)["length"].sum()) for k in store.keys())
    results = []
    for depth in depths:
        # Slots are reused round-robin; more slots than reads in flight keeps passes race-free.
        n_slots = min(max(2 * depth, 16), len(store.keys()))
        arena = Arena.create(n_slots, store.manifest.slot_bytes, prefix="flashmoe-iobench")
        opened = []
        try:
            for kind in engines:
                opened.append(open_engine(kind, arena.mmap, arena.slot_bytes, n_slots,
                                          store.stripe_paths, depth)[0])
            ceilings, passes = [], {i: [] for i in range(len(opened))}
            contenders = list(range(len(opened))) + ([-1] if with_fio else [])
            for _ in range(repeat):
                # A new order each round: this kind of disk bursts, then throttles, so a fixed
                # order would favour whoever runs first.
                for i in rng.permutation(contenders):
                    if i < 0:
                        ceilings.append(fio_ceiling(store, depth, total))
                    else:
                        passes[i].append(run_pass(store, engine=opened[i], n_slots=n_slots,
                                                  rng=rng))
        finally:
            for engine in opened:
                engine.close()
            arena.close()
        ceiling = statistics.median(ceilings) if ceilings and None not in ceilings else None
        for i, engine in enumerate(opened):
            mb = statistics.median(p[0] for p in passes[i])
            lat = np.concatenate([p[1] for p in passes[i]])
            results.append(IOBenchResult(
                engine.name, store.manifest.block_size, depth, round(mb, 1),
                round(float(np.percentile(lat, 50)), 1), round(float(np.percentile(lat, 99)), 1),
                round(ceiling, 1) if ceiling else None,
                round(mb / ceiling, 3) if ceiling else None, passes[i][0][2], len(store.keys())))
    return results


def format_table(results: list[IOBenchResult]) -> str:
    head = f"{'engine':<7} {'block':>7} {'depth':>5} {'MB/s':>8} {'p50 us':>9} {'p99 us':>9} " \
           f"{'fio MB/s':>9} {'ratio':>6}"
    rows = [head, "-" * len(head)]
    for r in results:
        ceiling = f"{r.ceiling_mb_per_s:9.1f}" if r.ceiling_mb_per_s else f"{'n/a':>9}"
        ratio = f"{r.ratio:6.3f}" if r.ratio else f"{'n/a':>6}"
        rows.append(f"{r.engine:<7} {r.block_size // 1024:>6}K {r.depth:>5} {r.mb_per_s:8.1f} "
                    f"{r.p50_us:9.1f} {r.p99_us:9.1f} {ceiling} {ratio}")
    return "\n".join(rows)


def report(results: list[IOBenchResult], store_path: str) -> dict:
    """The JSON document: every run under ``runs``; a single run's keys also at top level."""
    runs = [asdict(r) for r in results]
    doc = {"store": str(store_path), "runs": runs}
    if len(runs) == 1:
        doc.update(runs[0])
    return doc
