"""Writing a block-striped expert store (the format of ``common/store.py``).

One writer for every way a store is made: `flashmoe convert` (tensors read from a checkpoint)
and `flashmoe synth-store` (random weights of a model's shape). The caller describes each
expert's tensors and fills their bytes; the writer lays them out (each tensor aligned to
``TENSOR_ALIGN``), cuts them into blocks, stripes the blocks, checksums them, writes the side
files, fsyncs everything and renames the manifest into place last, all under the store's
write lock (``common.store.write_lock``): a store that a running process has open is refused,
not rewritten under it.
"""

from __future__ import annotations

import json
import os
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from common.checkpoints import fsync_path, write_text_durably
from common.safetensors_io import write_safetensors
from common.store import (ALIGN, CONFIG_NAME, FORMAT_VERSION, MANIFEST_NAME, NON_EXPERT_NAME,
                          SIDE_FILES, TENSOR_ALIGN, ExpertEntry, FileEntry, Manifest,
                          TensorEntry, block_location, block_read_len, expected_stripe_sizes,
                          file_crc32, round_up, stripe_name, write_lock)


@dataclass(frozen=True)
class TensorSpec:
    name: str  # projection name inside the expert, e.g. "gate_proj"
    key: str  # where it came from (a checkpoint key), for the manifest
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class StoreMeta:
    model_family: str
    model_type: str
    num_layers: int
    top_k: int


# fill(expert, tensor, destination): write the tensor's bytes into ``destination``.
Fill = Callable[[ExpertEntry, TensorEntry, memoryview], None]
# (name, dtype, shape, raw bytes) of each non-expert tensor.
NonExpertTensors = list[tuple[str, str, tuple[int, ...], bytes | memoryview]]


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def plan_experts(specs: dict[tuple[int, int], list[TensorSpec]], block_size: int,
                 where: str) -> list[ExpertEntry]:
    """Layout of every expert: tensors in the given order, each aligned, consecutive blocks."""
    experts: list[ExpertEntry] = []
    next_block = 0
    for layer, expert in sorted(specs):
        offset, tensors = 0, []
        for spec in specs[(layer, expert)]:
            offset = round_up(offset, TENSOR_ALIGN)
            tensors.append(TensorEntry(spec.name, spec.key, spec.dtype, spec.shape, offset,
                                       spec.nbytes))
            offset += spec.nbytes
        n_blocks = -(-offset // block_size)
        entry = ExpertEntry(layer, expert, offset, next_block, n_blocks, tuple(tensors))
        entry.validate(where)  # a tensor whose bytes disagree with its shape
        experts.append(entry)
        next_block += n_blocks
    return experts


def write_store(store_dir: Path, meta: StoreMeta, specs: dict[tuple[int, int], list[TensorSpec]],
                fill: Fill, non_expert: Callable[[], NonExpertTensors], config_bytes: bytes,
                block_size: int, parallelism: int, show_progress: bool = True,
                desc: str = "write store", locked: bool = False) -> Manifest:
    """Write a whole store at ``store_dir`` (replacing one there) under its write lock
    (``locked``: the caller holds it already). The progress bar goes to stderr, only when it
    is a terminal; ``show_progress=False`` turns it off everywhere."""
    if block_size <= 0 or block_size % ALIGN:
        raise ValueError(f"block size {block_size} must be a positive multiple of {ALIGN}")
    if parallelism < 1:
        raise ValueError(f"parallelism {parallelism} must be at least 1")
    experts = plan_experts(specs, block_size, str(store_dir))
    with nullcontext() if locked else write_lock(store_dir):
        return _write(store_dir, meta, experts, fill, non_expert, config_bytes, block_size,
                      parallelism, show_progress, desc)


def _write(store_dir: Path, meta: StoreMeta, experts: list[ExpertEntry], fill: Fill,
           non_expert: Callable[[], NonExpertTensors], config_bytes: bytes, block_size: int,
           parallelism: int, show_progress: bool, desc: str) -> Manifest:
    n_blocks = sum(e.n_blocks for e in experts)
    store_dir.mkdir(parents=True, exist_ok=True)
    # A store being rewritten must never look valid half-way: drop the old manifest first.
    (store_dir / MANIFEST_NAME).unlink(missing_ok=True)
    crcs = [0] * n_blocks
    fds = [os.open(store_dir / stripe_name(k), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
           for k in range(parallelism)]
    total = sum(e.nbytes for e in experts)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc=desc,
                  disable=None if show_progress else True) as bar:
            for e in experts:
                buf = bytearray(e.n_blocks * block_size)
                view = memoryview(buf)
                for t in e.tensors:
                    fill(e, t, view[t.offset:t.offset + t.nbytes])
                for i in range(e.n_blocks):
                    block = e.first_block + i
                    stripe, offset = block_location(block, block_size, parallelism)
                    data = view[i * block_size:i * block_size + block_read_len(e, i, block_size)]
                    crcs[block] = zlib.crc32(data)
                    os.pwrite(fds[stripe], data, offset)
                bar.update(e.nbytes)
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    write_safetensors(store_dir / NON_EXPERT_NAME, non_expert())
    fsync_path(store_dir / NON_EXPERT_NAME)
    write_synced(store_dir / CONFIG_NAME, config_bytes)
    # Checksummed from the written files, read back the way `verify` reads them.
    files = tuple(FileEntry(name, *file_crc32(store_dir / name)) for name in SIDE_FILES)
    moe_layers = sorted({e.layer for e in experts})
    manifest = Manifest(
        FORMAT_VERSION, meta.model_family, meta.model_type, meta.num_layers, tuple(moe_layers),
        max(e.expert for e in experts) + 1, meta.top_k, block_size, parallelism,
        tuple(experts), tuple(crcs), tuple(expected_stripe_sizes(experts, block_size,
                                                                  parallelism)), files)
    manifest.validate(str(store_dir))
    write_text_durably(store_dir / MANIFEST_NAME, json.dumps(manifest.to_json()))
    return manifest
