"""`flashmoe convert`: a Hugging Face MoE checkpoint folder -> a block-striped expert store.

The family adapter (``common/model_families.py``) says which tensors are experts'; a family
that keeps a layer's experts fused on disk (GPT-OSS) has each fused tensor cut into its
per-expert slices, byte for byte. The checkpoint's tokenizer files are copied into the store
so that the store alone is enough to generate text.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from pathlib import Path

from common.checkpoints import fsync_path
from common.model_families import ExpertPart, UnsupportedModelError, family_for_config
from common.safetensors_io import TensorReader, TensorRef, index_checkpoint
from common.store import CONFIG_NAME, MANIFEST_NAME, Manifest, StoreError, write_lock
from flashmoe.tools.store_writer import StoreMeta, TensorSpec, write_store

# Files of a checkpoint folder that text generation needs beside the weights (the tokenizer's,
# the generation defaults); the store carries those there are, unchecked by `verify`.
GENERATION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json", "generation_config.json")


def _copy_generation_files(hf_dir: Path, store_dir: Path) -> None:
    """Copy the GENERATION_FILES there are; drop those an earlier store left that are not."""
    store_dir.mkdir(parents=True, exist_ok=True)
    for name in GENERATION_FILES:
        source, target = hf_dir / name, store_dir / name
        if source.is_file():
            shutil.copyfile(source, target)
            fsync_path(target)
        else:
            target.unlink(missing_ok=True)


def check_target(hf_dir: str | os.PathLike, store_dir: str | os.PathLike,
                 force: bool = False) -> None:
    """Refuse, before anything is written, a target folder whose contents a conversion would
    replace: a non-empty folder, above all one holding a ``config.json`` (a checkpoint folder,
    given as the target by swapped arguments), unless ``force``."""
    out = Path(store_dir)
    if out.exists() and not out.is_dir():
        raise StoreError(f"{out}: exists and is not a folder; give the store a new folder")
    if force or not out.exists():
        return
    if (out / MANIFEST_NAME).is_file():
        raise StoreError(f"{out} already holds a FlashMoE store; add --force to replace it, or "
                         f"convert into a new folder")
    if (out / CONFIG_NAME).exists():
        raise StoreError(f"{out} holds a {CONFIG_NAME} (a checkpoint folder? the arguments are "
                         f"HF_DIR then STORE); convert into a new folder, or add --force to "
                         f"overwrite it")
    if any(out.iterdir()):
        raise StoreError(f"{out} is not empty; convert into a new or empty folder, or add "
                         f"--force to write the store among what is there")


def convert_checkpoint(hf_dir: str | os.PathLike, store_dir: str | os.PathLike,
                       block_size: int = 256 * 1024, parallelism: int = 4,
                       show_progress: bool = True) -> Manifest:
    """Convert a checkpoint folder into a store at ``store_dir`` (replacing one there).

    The progress bar goes to stderr, and only when it is a terminal; ``show_progress=False``
    turns it off everywhere."""
    hf_dir, store_dir = Path(hf_dir), Path(store_dir)
    config_path = hf_dir / CONFIG_NAME
    if not hf_dir.is_dir():
        raise StoreError(f"{hf_dir}: no such checkpoint folder")
    if store_dir.resolve() == hf_dir.resolve():
        raise StoreError(f"{store_dir} is the checkpoint folder itself; give the store a folder "
                         f"of its own")
    if not config_path.is_file():
        raise StoreError(f"{hf_dir}: no {CONFIG_NAME}; not a Hugging Face checkpoint folder")
    config_bytes = config_path.read_bytes()
    config = json.loads(config_bytes)
    family = family_for_config(config)
    refs = index_checkpoint(hf_dir)

    # (layer, expert) -> projection -> (checkpoint tensor, the expert's part of it)
    by_expert: dict[tuple[int, int], dict[str, tuple[TensorRef, ExpertPart]]] = defaultdict(dict)
    non_expert = []
    for key, ref in refs.items():
        parts = family.expert_parts(key, ref.shape)
        if parts is None:
            non_expert.append(ref)
            continue
        for part in parts:
            by_expert[(part.layer, part.expert)][part.projection] = (ref, part)
    if not by_expert:
        raise UnsupportedModelError(f"{hf_dir}: no expert tensors of family {family.name} found")
    for (layer, expert), projections in by_expert.items():
        missing = set(family.projections) - set(projections)
        if missing:
            raise StoreError(f"{hf_dir}: layer {layer} expert {expert} lacks {sorted(missing)}")

    def spec(name: str, ref: TensorRef, part: ExpertPart) -> TensorSpec:
        key = family.part_key(ref.name, part)
        if part.index is None:
            return TensorSpec(name, key, ref.dtype, ref.shape, ref.nbytes)
        return TensorSpec(name, key, ref.dtype, ref.shape[1:], ref.nbytes // ref.shape[0])

    specs = {key: [spec(name, *projections[name]) for name in family.projections]
             for key, projections in by_expert.items()}
    meta = StoreMeta(family.name, config["model_type"],
                     int(config.get("num_hidden_layers", len({l for l, _ in by_expert}))),
                     int(config.get(family.top_k_key, 0)))
    reader = TensorReader()

    def fill(expert, tensor, destination) -> None:
        ref, part = by_expert[(expert.layer, expert.expert)][tensor.name]
        data = reader.view(ref)
        destination[:] = data if part.index is None else \
            data[part.index * tensor.nbytes:(part.index + 1) * tensor.nbytes]

    try:
        with write_lock(store_dir):
            # No manifest while the folder holds a mix of old and new files.
            (store_dir / MANIFEST_NAME).unlink(missing_ok=True)
            _copy_generation_files(hf_dir, store_dir)
            return write_store(store_dir, meta, specs, fill,
                               lambda: [(r.name, r.dtype, r.shape, reader.view(r))
                                        for r in non_expert],
                               config_bytes, block_size, parallelism, show_progress,
                               desc="convert", locked=True)
    finally:
        reader.close()
