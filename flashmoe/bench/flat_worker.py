"""The worker of e2e-bench's mmap and ram modes: the trace-driven worker's compute on experts
read from one flat file, memory-mapped (through the page cache) or read whole into RAM.

Run by ``flashmoe.bench.e2e`` as ``python -m flashmoe.bench.flat_worker``; it writes its
per-token times, load time and bytes read as JSON.
"""

from __future__ import annotations

import argparse
import json
import mmap as mmap_module
import os
import sys
import time
from pathlib import Path

from common.arena import expert_torch_views
from common.model_families import FAMILIES
from common.store import ExpertStore
from common.traces import load_trace
from flashmoe.bench.e2e import read_bytes
from services.inference_worker.trace_compute import TraceExperts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flashmoe.bench.flat_worker",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--file", required=True, help="the flat expert file (its index: FILE.json)")
    p.add_argument("--store", required=True)
    p.add_argument("--trace", default="gptoss20b:eval")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--in-ram", action="store_true")
    p.add_argument("--cgroup", default="", help="join this memory cgroup after start-up")
    p.add_argument("--json", required=True)
    return p.parse_args(argv)


def work(args: argparse.Namespace) -> int:
    """Replay the trace's first --tokens decode steps on the flat file's experts."""
    index = json.loads(Path(args.file).with_suffix(".json").read_text())["experts"]
    store = ExpertStore.open(args.store)

    trace = load_trace(args.trace)
    compute = TraceExperts(args.store, lambda *a: fetch(*a))
    if args.cgroup:  # from here on, what this process maps and allocates counts
        (Path(args.cgroup) / "cgroup.procs").write_text(str(os.getpid()))
    fd = os.open(args.file, os.O_RDONLY)
    size = os.fstat(fd).st_size
    started = time.perf_counter()
    if args.in_ram:
        buffer = bytearray(size)
        view = memoryview(buffer)
        with open(args.file, "rb", buffering=0) as f:
            got = 0
            while got < size:
                got += f.readinto(view[got:])
    else:
        buffer = mmap_module.mmap(fd, size, mmap_module.MAP_SHARED, mmap_module.PROT_READ)
    load_s = time.perf_counter() - started
    family = FAMILIES[store.manifest.model_family]

    # The file's bytes stay where they are: each expert's views are made once, on first use.
    views: dict[tuple[int, int], dict] = {}

    def fetch(layer, experts, release, token, weights=()):
        out = []
        for expert in experts:
            params = views.get((layer, expert))
            if params is None:
                offset, _ = index[f"{layer},{expert}"]
                entry = store.expert(layer, expert)
                data = memoryview(buffer)[offset:offset + entry.nbytes]
                params = views[layer, expert] = family.expert_parameters(
                    entry, data, expert_torch_views(data, entry))
            out.append(params)
        return out

    token_ms = []
    before = read_bytes(os.getpid())
    k = trace.top_k
    for t in range(min(args.tokens, trace.n_tokens)):
        t0 = time.perf_counter()
        hidden = compute.new_token("")
        for layer in range(trace.num_layers):
            weights = trace.probs[t, layer].astype(float).tolist() \
                if trace.probs is not None else [1.0 / k] * k
            hidden = compute.step(hidden, layer, trace.experts[t, layer].tolist(), weights)
        token_ms.append((time.perf_counter() - t0) * 1e3)
    Path(args.json).write_text(json.dumps({"token_ms": token_ms, "load_s": load_s,
                                           "read_bytes": read_bytes(os.getpid()) - before}))
    return 0


if __name__ == "__main__":
    sys.exit(work(parse_args()))
