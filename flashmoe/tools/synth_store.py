"""`flashmoe synth-store`: a real store of random bf16 experts in a real model's shape.

For trace-driven runs: the routing comes from a recorded trace (the shared gpt-oss-20b trace),
the expert weights are random but have the model's shapes, so the cache manager, the IO engine
and the worker's matrix products all run on real bytes. ``scale`` multiplies each expert's
intermediate size (rounded to a multiple of 32): bytes per expert, IO per miss and compute
per expert all shrink with it about linearly, so the IO-to-compute ratio of a miss stays
roughly that of the full model, while the store fits the disk and the run fits the time.
At scale 1 a gpt-oss-20b expert is 49.8 MB in bf16 (38 GB for all 768); the default 0.21
gives about 8 GB.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.model_families import (GPT_OSS_PROJECTIONS, SYNTH_SHAPES, SynthShape,
                                    gpt_oss_expert_shapes)
from common.store import ExpertStore, StoreError
from flashmoe.tools.store_writer import StoreMeta, TensorSpec, write_store

DEFAULT_SCALE = 0.21
POOL_VALUES = 1 << 24  # random bf16 values that experts are cut from


def scaled_intermediate(shape: SynthShape, scale: float) -> int:
    if not 0 < scale <= 1:
        raise StoreError(f"scale {scale} must be in (0, 1]")
    step = min(32, shape.intermediate)
    return max(step, int(round(shape.intermediate * scale / step)) * step)


def _bf16_pool(rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """Random normal values as bf16 bit patterns (round to nearest even)."""
    bits = (rng.standard_normal(POOL_VALUES, dtype=np.float32) * std).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def check_synth_target(out: str | Path, force: bool = False) -> None:
    """Refuse, before anything is written, a target folder that holds something other than a
    synthetic store (which is reused or replaced), unless ``force``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise StoreError(f"{out}: exists and is not a folder; give the store a new folder")
    if force or not out.exists() or not any(out.iterdir()):
        return
    try:
        synthetic = "flashmoe_synthetic" in json.loads((out / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        synthetic = False
    if not synthetic:
        raise StoreError(f"{out} is not empty and holds no synthetic store; give a new or "
                         f"empty folder, or add --force to write the store among what is there")


def synth_store(out: str | Path, shape_name: str = "gpt-oss-20b", scale: float = DEFAULT_SCALE,
                block_size: int = 256 * 1024, parallelism: int = 4, seed: int = 0,
                show_progress: bool = True) -> ExpertStore:
    """Write the store (or reuse one made with the same arguments); returns it opened."""
    if shape_name not in SYNTH_SHAPES:
        raise StoreError(f"no synthetic shape {shape_name!r} (choices: "
                         f"{', '.join(SYNTH_SHAPES)})")
    shape = SYNTH_SHAPES[shape_name]
    out = Path(out)
    intermediate = scaled_intermediate(shape, scale)
    config = {"model_type": shape.model_type, "hidden_size": shape.hidden,
              "intermediate_size": intermediate, "num_hidden_layers": shape.layers,
              "num_local_experts": shape.experts, "num_experts_per_tok": shape.top_k,
              "flashmoe_synthetic": {"shape": shape.name, "scale": scale, "seed": seed,
                                     "block_size": block_size, "parallelism": parallelism}}
    try:
        with ExpertStore.open(out):  # closed: its lock would refuse the writer
            existing = json.loads((out / "config.json").read_text()).get("flashmoe_synthetic")
        if existing == config["flashmoe_synthetic"]:
            return ExpertStore.open(out)
    except (StoreError, OSError, ValueError, AttributeError):
        pass
    shapes = gpt_oss_expert_shapes(shape.hidden, intermediate)
    specs = {(layer, expert): [TensorSpec(name, f"model.layers.{layer}.mlp.experts.{name}"
                                                f"[{expert}]", "BF16", shapes[name],
                                          2 * int(np.prod(shapes[name])))
                               for name in GPT_OSS_PROJECTIONS]
             for layer in range(shape.layers) for expert in range(shape.experts)}
    rng = np.random.default_rng(seed)
    pool = _bf16_pool(rng).view(np.uint8)
    pool = np.concatenate([pool, pool])  # any window of up to the pool's size is contiguous

    def fill(expert, tensor, destination) -> None:
        n = tensor.nbytes
        if n > POOL_VALUES * 2:
            raise StoreError(f"tensor {tensor.name} is larger than the random pool")
        start = int(rng.integers(0, POOL_VALUES)) * 2
        destination[:] = pool[start:start + n].data

    write_store(out, StoreMeta("gpt_oss", shape.model_type, shape.layers, shape.top_k), specs,
                fill, lambda: [], json.dumps(config, indent=1).encode(), block_size,
                parallelism, show_progress, desc="synth-store")
    return ExpertStore.open(out)
