"""`flashmoe convert`: a Hugging Face MoE checkpoint folder -> a block-striped expert store."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

from common.model_families import UnsupportedModelError, family_for_config
from common.safetensors_io import TensorReader, index_checkpoint
from common.store import CONFIG_NAME, Manifest, StoreError
from flashmoe.store_writer import StoreMeta, TensorSpec, write_store


def convert_checkpoint(hf_dir: str | os.PathLike, store_dir: str | os.PathLike,
                       block_size: int = 256 * 1024, parallelism: int = 4,
                       show_progress: bool = True) -> Manifest:
    """Convert a checkpoint folder into a store at ``store_dir`` (replacing one there).

    The progress bar goes to stderr, and only when it is a terminal; ``show_progress=False``
    turns it off everywhere."""
    hf_dir, store_dir = Path(hf_dir), Path(store_dir)
    config_path = hf_dir / CONFIG_NAME
    if not config_path.is_file():
        raise StoreError(f"{hf_dir}: no {CONFIG_NAME}; not a Hugging Face checkpoint folder")
    config_bytes = config_path.read_bytes()
    config = json.loads(config_bytes)
    family = family_for_config(config)
    refs = index_checkpoint(hf_dir)

    by_expert: dict[tuple[int, int], dict[str, object]] = defaultdict(dict)
    non_expert = []
    for key, ref in refs.items():
        parsed = family.parse_key(key)
        if parsed is None:
            non_expert.append(ref)
        else:
            layer, expert, projection = parsed
            by_expert[(layer, expert)][projection] = ref
    if not by_expert:
        raise UnsupportedModelError(f"{hf_dir}: no expert tensors of family {family.name} found")
    for (layer, expert), projections in by_expert.items():
        missing = set(family.projections) - set(projections)
        if missing:
            raise StoreError(f"{hf_dir}: layer {layer} expert {expert} lacks {sorted(missing)}")
    specs = {key: [TensorSpec(name, ref.name, ref.dtype, ref.shape, ref.nbytes)
                   for name, ref in ((n, projections[n]) for n in family.projections)]
             for key, projections in by_expert.items()}
    meta = StoreMeta(family.name, config["model_type"],
                     int(config.get("num_hidden_layers", len({l for l, _ in by_expert}))),
                     int(config.get(family.top_k_key, 0)))
    reader = TensorReader()

    def fill(expert, tensor, destination) -> None:
        destination[:] = reader.view(by_expert[(expert.layer, expert.expert)][tensor.name])

    try:
        return write_store(store_dir, meta, specs, fill,
                           lambda: [(r.name, r.dtype, r.shape, reader.view(r))
                                    for r in non_expert],
                           config_bytes, block_size, parallelism, show_progress, desc="convert")
    finally:
        reader.close()
