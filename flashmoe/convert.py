"""`flashmoe convert`: a Hugging Face MoE checkpoint folder -> a block-striped expert store."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from common.model_families import UnsupportedModelError, family_for_config
from common.safetensors_io import TensorReader, index_checkpoint, write_safetensors
from common.store import (ALIGN, FORMAT_VERSION, MANIFEST_NAME, NON_EXPERT_NAME, TENSOR_ALIGN,
                          ExpertEntry, Manifest, StoreError, TensorEntry, block_location,
                          block_read_len, expected_stripe_sizes, round_up, stripe_name)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert_checkpoint(hf_dir: str | os.PathLike, store_dir: str | os.PathLike,
                       block_size: int = 256 * 1024, parallelism: int = 4,
                       show_progress: bool = True) -> Manifest:
    hf_dir, store_dir = Path(hf_dir), Path(store_dir)
    if block_size <= 0 or block_size % ALIGN:
        raise ValueError(f"block size {block_size} must be a positive multiple of {ALIGN}")
    if parallelism < 1:
        raise ValueError(f"parallelism {parallelism} must be at least 1")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise StoreError(f"{hf_dir}: no config.json; not a Hugging Face checkpoint folder")
    config = json.loads(config_path.read_text())
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

    experts: list[ExpertEntry] = []
    next_block = 0
    for layer, expert in sorted(by_expert):
        offset, tensors = 0, []
        for name in family.projections:
            ref = by_expert[(layer, expert)][name]
            offset = round_up(offset, TENSOR_ALIGN)
            tensors.append(TensorEntry(name, ref.name, ref.dtype, ref.shape, offset, ref.nbytes))
            offset += ref.nbytes
        n_blocks = -(-offset // block_size)
        experts.append(ExpertEntry(layer, expert, offset, next_block, n_blocks, tuple(tensors)))
        next_block += n_blocks

    store_dir.mkdir(parents=True, exist_ok=True)
    # A store being rewritten must never look valid half-way: drop the old manifest first.
    (store_dir / MANIFEST_NAME).unlink(missing_ok=True)
    reader = TensorReader()
    crcs = [0] * next_block
    fds = [os.open(store_dir / stripe_name(k), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
           for k in range(parallelism)]
    total = sum(e.nbytes for e in experts)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="convert",
                  disable=not show_progress) as bar:
            for e in experts:
                buf = bytearray(e.n_blocks * block_size)
                for t in e.tensors:
                    buf[t.offset:t.offset + t.nbytes] = reader.view(
                        by_expert[(e.layer, e.expert)][t.name])
                view = memoryview(buf)
                for i in range(e.n_blocks):
                    block = e.first_block + i
                    stripe, offset = block_location(block, block_size, parallelism)
                    data = view[i * block_size:i * block_size + block_read_len(e, i, block_size)]
                    crcs[block] = zlib.crc32(data)
                    os.pwrite(fds[stripe], data, offset)
                bar.update(e.nbytes)
        for fd in fds:
            os.fsync(fd)
        write_safetensors(store_dir / NON_EXPERT_NAME,
                          ((r.name, r.dtype, r.shape, reader.view(r)) for r in non_expert))
    finally:
        for fd in fds:
            os.close(fd)
        reader.close()
    shutil.copyfile(config_path, store_dir / "config.json")

    moe_layers = sorted({e.layer for e in experts})
    manifest = Manifest(
        FORMAT_VERSION, family.name, config["model_type"],
        int(config.get("num_hidden_layers", len(moe_layers))), tuple(moe_layers),
        max(e.expert for e in experts) + 1, int(config.get(family.top_k_key, 0)),
        block_size, parallelism, tuple(experts), tuple(crcs),
        tuple(expected_stripe_sizes(experts, block_size, parallelism)))
    tmp = store_dir / (MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest.to_json(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, store_dir / MANIFEST_NAME)
    _fsync_path(store_dir)
    return manifest
