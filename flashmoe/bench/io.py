"""`flashmoe io-bench`: read every expert of a store in random order through an IO engine and
compare with the device's best for the same bytes, as fio measures it on the same stripe files.

The ceiling: the engine reads an expert's consecutive blocks of one stripe back to back, and the
block layer merges them into larger requests, so fio at the block size alone understates what
the device gives for those bytes (a ratio above 1), and one pass of fio over a bursty shared
disk swings widely. So fio runs time-based (a ramp, then a few seconds measured, O_DIRECT,
io_uring) at two request sizes, the block size and one expert's contiguous extent per stripe
(expert bytes / parallelism, rounded up to 4096); the higher median is the ceiling.

Per (contender, depth) it reports the median MB/s of ``repeat`` interleaved rounds with its
spread (min..max), p50/p99 per-expert read latency (first block submitted -> last block
completed, under the benchmark's load), the ceiling with its spread, and their ratio. Each
round runs every contender once (fio at each size, each engine, each extra contender) in a
fresh random order, so that the disk's drift hits all alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable, ContextManager

import numpy as np

from common.arena import Arena
from common.store import ALIGN, ExpertStore, round_up
from flashmoe.cli.options import add_json, csv, save
from services.cache_manager.io_engine import open_engine

log = logging.getLogger(__name__)

FIO_RUNTIME_S = 3.0  # measured seconds of each fio run
FIO_RAMP_S = 1.0  # seconds fio runs before it starts measuring
PASS_TIMEOUT_S = 600.0  # one engine pass over the store; only bounds a hang

# One pass of a contender: (MB/s, per-expert latencies in us, bytes read).
PassResult = tuple[float, list[float], int]


@dataclass
class IOBenchResult:
    engine: str  # engine name, or an extra contender's name
    block_size: int
    depth: int
    mb_per_s: float  # median over rounds
    mb_per_s_min: float
    mb_per_s_max: float
    p50_us: float  # per-expert read latency, over every round's experts
    p99_us: float
    ceiling_mb_per_s: float | None  # the better fio median (None without fio)
    ceiling_min: float | None
    ceiling_max: float | None
    ceiling_bs: int | None  # the request size of that fio run
    ratio: float | None  # mb_per_s / ceiling_mb_per_s
    fio_block_mb_per_s: float | None  # fio median at the block size
    fio_extent_mb_per_s: float | None  # fio median at extent_bytes (None when that is a block)
    extent_bytes: int
    bytes_read: int
    experts: int
    rounds: int


def drop_page_cache() -> bool:
    """Drop the page cache where permitted (root); O_DIRECT reads bypass it anyway."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def fio_missing() -> str | None:
    """Why no fio ceiling can be measured here, or None."""
    return None if shutil.which("fio") else "fio is not installed (apt-get install fio)"


def expert_extent_bytes(store: ExpertStore) -> int:
    """One expert's contiguous bytes in one stripe: expert bytes / parallelism, rounded up."""
    largest = max(e.nbytes for e in store.manifest.experts)
    return round_up(-(-largest // store.manifest.parallelism), ALIGN)


def fio_mb_per_s(store: ExpertStore, bs: int, depth: int, runtime_s: float = FIO_RUNTIME_S,
                 ramp_s: float = FIO_RAMP_S) -> float:
    """fio random O_DIRECT reads over the stripe files at request size ``bs`` and ``depth``,
    time-based: MB/s measured after the ramp."""
    files = ":".join(str(p).replace(":", "\\:") for p in store.stripe_paths)
    cmd = [shutil.which("fio") or "fio", "--name=ceiling", f"--filename={files}",
           "--rw=randread", f"--bs={bs}", f"--iodepth={depth}", "--direct=1",
           "--ioengine=io_uring", "--time_based", f"--runtime={int(runtime_s * 1000)}ms",
           f"--ramp_time={int(ramp_s * 1000)}ms", "--output-format=json", "--randrepeat=0"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed: {' '.join(cmd)}\n{proc.stderr.strip()}")
    fio_json = json.loads(proc.stdout[proc.stdout.index("{"):])
    return fio_json["jobs"][0]["read"]["bw_bytes"] / 1e6


def run_pass(store: ExpertStore, engine, n_slots: int, rng: np.random.Generator) -> PassResult:
    """Every expert once, in a random order, as one batch through ``engine``."""
    keys = store.keys()
    order = rng.permutation(len(keys))
    per_expert = [store.read_ops(*keys[k], slot=i % n_slots) for i, k in enumerate(order)]
    bounds = np.cumsum([0] + [len(ops) for ops in per_expert])
    ops = np.concatenate(per_expert)
    drop_page_cache()
    start = time.perf_counter()
    engine.read(ops, timeout_s=PASS_TIMEOUT_S)
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


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def io_bench(store_path: str, engines: list[str], depths: list[int], repeat: int = 5,
             seed: int = 0, with_fio: bool = True,
             extra: dict[str, Callable[[int], ContextManager[Callable[[], PassResult]]]]
             | None = None,
             fio_runtime_s: float = FIO_RUNTIME_S,
             fio_ramp_s: float = FIO_RAMP_S) -> list[IOBenchResult]:
    """Per depth, ``repeat`` rounds in which fio (at the block size and at the expert extent),
    each engine and each ``extra`` contender run once, in a fresh random order per round;
    figures are per-contender medians with their spread. An extra contender is a factory:
    given the depth, a context manager that yields a callable running one pass and returning
    (MB/s, per-expert latencies in us, bytes); it runs in the rounds of every depth and is
    reported with that depth. Without fio (``with_fio`` False or fio missing) the ceiling and
    ratio are None."""
    store = ExpertStore.open(store_path)
    rng = np.random.default_rng(seed)
    block = store.manifest.block_size
    extent = expert_extent_bytes(store)
    fio_sizes = []
    if with_fio and fio_missing():
        log.warning("no fio ceiling: %s", fio_missing())
    elif with_fio:
        fio_sizes = [block, extent] if extent > block else [block]
    extra = extra or {}
    results = []
    for depth in depths:
        # Slots are reused round-robin; more slots than reads in flight keeps passes race-free.
        n_slots = min(max(2 * depth, 16), len(store.keys()))
        arena = Arena.create(n_slots, store.manifest.slot_bytes, prefix="flashmoe-iobench")
        contexts = ExitStack()
        opened = []
        try:
            for kind in engines:
                opened.append(open_engine(kind, arena.mmap, arena.slot_bytes, n_slots,
                                          store.stripe_paths, depth)[0])
            runners = {("fio", bs): partial(fio_mb_per_s, store, bs, depth, fio_runtime_s,
                                            fio_ramp_s) for bs in fio_sizes}
            runners.update({("engine", i): partial(run_pass, store, engine, n_slots, rng)
                            for i, engine in enumerate(opened)})
            runners.update({("extra", name): contexts.enter_context(factory(depth))
                            for name, factory in extra.items()})
            contenders = list(runners)
            outcomes = {key: [] for key in contenders}
            for _ in range(repeat):
                # A new order each round: this kind of disk bursts, then throttles, so a fixed
                # order would favour whoever runs first.
                for k in rng.permutation(len(contenders)):
                    outcomes[contenders[k]].append(runners[contenders[k]]())
        finally:
            contexts.close()
            for engine in opened:
                engine.close()
            arena.close()
        fio = {bs: _spread(outcomes[("fio", bs)]) for bs in fio_sizes}
        best_bs = max(fio, key=lambda bs: fio[bs][0]) if fio else None
        ceiling = fio[best_bs] if best_bs else (None, None, None)  # median, min, max
        named = [(engine.name, outcomes[("engine", i)]) for i, engine in enumerate(opened)]
        named += [(name, outcomes[("extra", name)]) for name in extra]
        for name, passes in named:
            mb, mb_min, mb_max = _spread([p[0] for p in passes])
            lat = np.concatenate([np.asarray(p[1], dtype=float) for p in passes])
            results.append(IOBenchResult(
                name, block, depth, round(mb, 1), round(mb_min, 1), round(mb_max, 1),
                round(float(np.percentile(lat, 50)), 1), round(float(np.percentile(lat, 99)), 1),
                *(round(c, 1) if c else None for c in ceiling), best_bs,
                round(mb / ceiling[0], 3) if ceiling[0] else None,
                round(fio[block][0], 1) if block in fio else None,
                round(fio[extent][0], 1) if extent in fio and extent != block else None,
                extent, passes[0][2], len(store.keys()), repeat))
    return results


def format_table(results: list[IOBenchResult]) -> str:
    def spread(mid: float | None, lo: float | None, hi: float | None) -> str:
        return f"{'n/a':>22}" if mid is None else f"{mid:8.1f} ({lo:5.0f}..{hi:5.0f})"

    head = (f"{'engine':<10} {'block':>6} {'depth':>5} {'MB/s (min..max)':>22} {'p50 us':>9} "
            f"{'p99 us':>9} {'ceiling MB/s (min..max)':>24} {'at':>6} {'ratio':>6}")
    rows = [head, "-" * len(head)]
    for r in results:
        at = f"{r.ceiling_bs // 1024}K" if r.ceiling_bs else "n/a"
        ratio = f"{r.ratio:6.3f}" if r.ratio else f"{'n/a':>6}"
        rows.append(f"{r.engine:<10} {r.block_size // 1024:>5}K {r.depth:>5} "
                    f"{spread(r.mb_per_s, r.mb_per_s_min, r.mb_per_s_max)} {r.p50_us:9.1f} "
                    f"{r.p99_us:9.1f}   {spread(r.ceiling_mb_per_s, r.ceiling_min, r.ceiling_max)}"
                    f" {at:>6} {ratio}")
    return "\n".join(rows)


def report(results: list[IOBenchResult], store_path: str) -> dict:
    """The JSON document: every run under ``runs``; a single run's keys also at top level."""
    runs = [asdict(r) for r in results]
    doc = {"store": str(store_path), "runs": runs}
    if len(runs) == 1:
        doc.update(runs[0])
    return doc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store")
    p.add_argument("--engine", type=csv(str), default=["uring"],
                   help="uring, pread or auto; comma-separated for several")
    p.add_argument("--depth", type=csv(int), default=[8], help="queue depth(s), e.g. 1,8,32")
    p.add_argument("--repeat", type=int, default=5, help="interleaved passes per figure (median)")
    p.add_argument("--no-fio", action="store_true", help="skip the fio ceiling")
    p.add_argument("--with-manager", action="store_true",
                   help="also a live cache manager loading every expert by PrefetchHints "
                        "(row manager-prefetch), in the same rounds")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    extra = {}
    if args.with_manager:
        from flashmoe.bench.prefetch_stream import manager_prefetch_stream

        extra["manager-prefetch"] = partial(manager_prefetch_stream, args.store)
    results = io_bench(args.store, args.engine, args.depth, repeat=args.repeat,
                       with_fio=not args.no_fio, extra=extra)
    print(format_table(results))
    save(args, report(results, args.store))
    return 0
