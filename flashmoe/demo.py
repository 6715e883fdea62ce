"""`flashmoe demo`, the README's main job until the full pipeline lands.

Builds a random-weight Qwen3-MoE checkpoint of about ``store_mib`` MiB of experts (transformers'
own model class, no download), converts it to a store, verifies it, and runs the IO benchmark
(io_uring and pread against fio) and the demand-path benchmark on it, then replays the small
warp OLMoE routing trace through every cache policy when ``../shared/traces`` is there. Results
go to ``<workdir>/results/``. Re-running reuses the model and store.
"""

from __future__ import annotations

import math
from pathlib import Path

from common.store import ExpertStore, StoreError
from common.traces import DEFAULT_TRACES_DIR, load_trace
from flashmoe import acquire_bench, io_bench, simulator
from flashmoe.convert import convert_checkpoint
from flashmoe.device_model import DEVICES, MODEL_SHAPES
from flashmoe.reports import write_json
from flashmoe.tiny_models import build_tiny_model
from services.cache_manager.policies import POLICIES

HIDDEN, EXPERT_INTERMEDIATE, LAYERS = 1024, 512, 8
EXPERT_MIB = 3 * HIDDEN * EXPERT_INTERMEDIATE * 2 / 2**20  # gate, up, down in bf16


def run_demo(workdir: Path, store_mib: int = 256) -> int:
    experts = max(8, math.ceil(store_mib / EXPERT_MIB / LAYERS))
    model_dir, store_dir, results = workdir / "model", workdir / "store", workdir / "results"
    tag = f"{LAYERS}x{experts}"
    if not (model_dir / tag).is_dir():
        print(f"[1/6] building a random-weight Qwen3-MoE: {LAYERS} layers x {experts} experts "
              f"of {EXPERT_MIB:.1f} MiB")
        build_tiny_model("qwen3_moe", model_dir / tag, layers=LAYERS, experts=experts, top_k=4,
                         hidden=HIDDEN, expert_intermediate=EXPERT_INTERMEDIATE)
    try:
        store = ExpertStore.open(store_dir / tag)
    except StoreError:
        print("[2/6] converting to a block-striped store")
        convert_checkpoint(model_dir / tag, store_dir / tag)
        store = ExpertStore.open(store_dir / tag)
    print("[3/6] verifying every block")
    bad = next(store.verify(), None)
    if bad is not None:
        print(f"store is corrupt: {bad}")
        return 1
    print("[4/6] IO engines against the fio ceiling (256 KiB blocks, depth 8)")
    runs = io_bench.io_bench(str(store.path), ["uring", "pread"], [8])
    print(io_bench.format_table(runs))
    write_json(io_bench.report(runs, str(store.path)), results / "io_bench.json")
    print("[5/6] demand path: AcquireReq round trip with every expert resident")
    result = acquire_bench.acquire_bench(str(store.path), iterations=5000)
    print(acquire_bench.format_table(result))
    write_json(result, results / "acquire_bench.json")
    if (DEFAULT_TRACES_DIR / "warp").is_dir():
        print("[6/6] every cache policy on the warp OLMoE routing trace (global scope)")
        report = simulator.run_bench(load_trace("warp:olmoe"), "global", [0.125, 0.25, 0.5],
                                     sorted(POLICIES), DEVICES["orin-980pro"],
                                     MODEL_SHAPES["olmoe-1b-7b"], progress=False)
        print(simulator.format_table(report))
        write_json(report, results / "bench_warp_olmoe.json")
    else:
        print(f"[6/6] skipped: no shared traces at {DEFAULT_TRACES_DIR}")
    print(f"results in {results}/")
    return 0
