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

import numpy as np
from tqdm import tqdm

from common.checkpoints import fsync_path, write_text_durably
from common.safetensors_io import write_safetensors
from common.model_families import FAMILIES, ModelFamily
from common.store import (ALIGN, CONFIG_NAME, COPY_PRECISIONS, FORMAT_VERSION, MANIFEST_NAME,
                          NATIVE, NON_EXPERT_NAME, SIDE_FILES, TENSOR_ALIGN, ExpertEntry,
                          ExpertStore, FileEntry, Manifest, StoreError, TensorEntry,
                          block_location, block_read_len, expected_stripe_sizes, file_crc32,
                          round_up, stripe_name, write_lock)


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
    store_dir.mkdir(parents=True, exist_ok=True)
    # A store being rewritten must never look valid half-way: drop the old manifest first.
    (store_dir / MANIFEST_NAME).unlink(missing_ok=True)
    for precision in COPY_PRECISIONS:  # copies of the experts written over are stale
        (store_dir / precision / MANIFEST_NAME).unlink(missing_ok=True)
    crcs = _write_stripes(store_dir, experts, fill, block_size, parallelism, show_progress, desc)
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


def _write_stripes(store_dir: Path, experts: list[ExpertEntry], fill: Fill, block_size: int,
                   parallelism: int, show_progress: bool, desc: str) -> list[int]:
    """Every expert's blocks into ``store_dir``'s stripe files (fsynced); their CRC-32s."""
    crcs = [0] * sum(e.n_blocks for e in experts)
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
    return crcs


# --- precision copies ---------------------------------------------------------------------------

def _read_expert(store: ExpertStore, e: ExpertEntry, files: list) -> memoryview:
    """One native expert's bytes, read and checksum-verified."""
    buf = bytearray(e.n_blocks * store.manifest.block_size)
    for op in store.read_ops(e.layer, e.expert, 0):
        n = int(op["length"])
        start = int(op["buf_offset"])
        got = os.preadv(files[int(op["file_index"])], [memoryview(buf)[start:start + n]],
                        int(op["file_offset"]))
        if got != n:
            raise StoreError(f"{store.path}: layer {e.layer} expert {e.expert} is cut short")
    view = memoryview(buf)
    store.verify_expert_bytes(e.layer, e.expert, view)
    return view


def _copy_tensors(family: ModelFamily, e: ExpertEntry, data: memoryview, precision: str,
                  group_size: int) -> list[tuple[str, str, tuple[int, ...], np.ndarray]]:
    """(name, dtype, shape, values) of one expert's copy: per in-memory parameter, a weight
    matrix as [out, in] rows quantized with ``<name>.scale`` beside it (``quant.copy_parts``
    names their dtypes and shapes), a bias as it is."""
    import torch

    from common import quant
    from common.arena import expert_torch_views

    dtypes = {t.name: t.dtype for t in e.tensors}  # a bias is one projection of the store
    out = []
    for name, t in family.expert_parameters(e, data, expert_torch_views(data, e)).items():
        if t.dim() != 2:
            out.append((name, dtypes[name], tuple(t.shape),
                        t.contiguous().view(torch.uint8).numpy()))
            continue
        values = quant.quantize(precision, t.float(), family.weights_in_out, group_size)
        parts = quant.copy_parts(tuple(t.shape), family.weights_in_out, precision, group_size)
        out += [(name if part.role == "q" else f"{name}.scale", part.dtype, tuple(part.shape),
                 v.contiguous().numpy()) for part, v in zip(parts, values)]
    return out


def missing_copies(store_dir: str | Path, precisions: list[str]) -> list[str]:
    """The copies among ``precisions`` that the store lacks (or holds stale or broken)."""
    with ExpertStore.open(store_dir) as store:
        return [p for p in dict.fromkeys(precisions)
                if p in COPY_PRECISIONS and p not in store.copies]


def add_copies(store_dir: str | Path, precisions: list[str], show_progress: bool = True
               ) -> list[str]:
    """Write the copies among ``precisions`` that the store lacks; returns those written.
    The store must not be open here (its writer's lock)."""
    missing = missing_copies(store_dir, precisions)
    return write_copies(store_dir, missing, show_progress=show_progress) if missing else []


def write_copies(store_dir: str | Path, precisions: list[str], group_size: int | None = None,
                 show_progress: bool = True) -> list[str]:
    """Add (or make again) the store's precision copies (``int8``, ``int4``; common/quant.py),
    each a folder of its own beside the native experts, under the store's write lock. Returns
    the precisions written."""
    from common import quant

    store_dir = Path(store_dir)
    group_size = group_size or quant.GROUP_SIZE
    wanted = [p for p in dict.fromkeys(precisions) if p not in (NATIVE, "bf16")]
    for p in wanted:
        if p not in COPY_PRECISIONS:
            raise ValueError(f"precision {p!r}: a copy is one of {list(COPY_PRECISIONS)}")
    if not wanted:
        return []
    with write_lock(store_dir):
        where = str(store_dir / MANIFEST_NAME)
        try:
            manifest = Manifest.from_json(json.loads((store_dir / MANIFEST_NAME).read_text()),
                                          where)
        except (OSError, ValueError) as exc:
            raise StoreError(f"{where}: cannot be read ({exc})") from None
        native = ExpertStore(store_dir, manifest)  # read under our own lock, no second one
        family = FAMILIES[manifest.model_family]
        files = [os.open(p, os.O_RDONLY) for p in native.stripe_paths]
        try:
            for precision in wanted:
                _write_copy(native, family, files, precision, group_size, show_progress)
        finally:
            for fd in files:
                os.close(fd)
    return wanted


def _write_copy(native: ExpertStore, family: ModelFamily, files: list, precision: str,
                group_size: int, show_progress: bool) -> Manifest:
    m = native.manifest
    folder = native.path / precision
    folder.mkdir(exist_ok=True)
    (folder / MANIFEST_NAME).unlink(missing_ok=True)
    from common.arena import expert_torch_views

    first = m.experts[0]
    layout = [(t.name, t.dtype, t.shape) for t in first.tensors]
    for e in m.experts:
        if [(t.name, t.dtype, t.shape) for t in e.tensors] != layout:
            raise StoreError(f"{native.path}: layer {e.layer} expert {e.expert} has another "
                             f"shape than layer {first.layer} expert {first.expert}; copies "
                             f"need experts of one shape")
    data = _read_expert(native, first, files)
    shapes = {name: list(t.shape) for name, t in family.expert_parameters(
        first, data, expert_torch_views(data, first)).items()}
    tensors = _copy_tensors(family, first, data, precision, group_size)
    template = [TensorSpec(name, name, dtype, shape, values.nbytes)
                for name, dtype, shape, values in tensors]
    specs = {(e.layer, e.expert): template for e in m.experts}
    pending = {(first.layer, first.expert): {name: values for name, _, _, values in tensors}}

    def fill(e: ExpertEntry, t: TensorEntry, destination: memoryview) -> None:
        key = (e.layer, e.expert)
        if key not in pending:
            pending.clear()
            tensors = _copy_tensors(family, native.expert(*key),
                                    _read_expert(native, native.expert(*key), files),
                                    precision, group_size)
            pending[key] = {name: values for name, _, _, values in tensors}
        destination[:] = pending[key][t.name].reshape(-1).view(np.uint8).data

    experts = plan_experts(specs, m.block_size, str(folder))
    crcs = _write_stripes(folder, experts, fill, m.block_size, m.parallelism, show_progress,
                          f"{precision} copy")
    quant_info = {"group_size": group_size, "source_digest": m.digest(),
                  "transposed": sorted(n for n, s in shapes.items()
                                       if len(s) == 2 and family.weights_in_out),
                  "native_shapes": shapes}
    copy = Manifest(FORMAT_VERSION, m.model_family, m.model_type, m.num_layers, m.moe_layers,
                    m.num_experts, m.top_k, m.block_size, m.parallelism, tuple(experts),
                    tuple(crcs), tuple(expected_stripe_sizes(experts, m.block_size,
                                                             m.parallelism)), (),
                    precision, quant_info)
    copy.validate(str(folder))
    write_text_durably(folder / MANIFEST_NAME, json.dumps(copy.to_json()))
    return copy
