"""The block-striped expert store: format, layout arithmetic, opening and verification.

A store folder holds ``manifest.json``, ``stripe_<k>.bin`` files, the model's ``config.json``
and its non-expert weights as ``non_expert.safetensors``.

Layout: each expert's bytes (its projections in family order, each aligned to
``TENSOR_ALIGN``) are cut into blocks of ``block_size``. Experts take consecutive *global*
block ids; global block b lives in stripe ``b % parallelism`` at offset
``(b // parallelism) * block_size``, so one expert read fans out over every stripe. A block
occupies its whole ``block_size`` slot in the stripe, but only ``read_len`` bytes (the valid
bytes rounded up to ``ALIGN``, zero padded) are written, read and checksummed. Checksums are
CRC-32 (zlib) over those ``read_len`` bytes. The manifest also records the size and CRC-32 of
``non_expert.safetensors`` and ``config.json``: opening checks their sizes, ``verify`` their
checksums.

The manifest is written last and renamed into place; a folder without a valid manifest is
not a store.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from common.safetensors_io import DTYPE_BYTES

FORMAT_VERSION = 2  # 2: sizes and checksums of the non-expert weights and config.json
MANIFEST_NAME = "manifest.json"
NON_EXPERT_NAME = "non_expert.safetensors"
CONFIG_NAME = "config.json"
SIDE_FILES = (NON_EXPERT_NAME, CONFIG_NAME)  # the store's files besides stripes and manifest
ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers
TENSOR_ALIGN = 256  # alignment of each projection inside an expert's bytes


class StoreError(RuntimeError):
    """A store is missing, malformed, truncated or corrupt."""


class ChecksumError(StoreError):
    """A block's bytes do not match its recorded checksum."""

    def __init__(self, layer: int, expert: int, block: int, stripe: int, offset: int) -> None:
        super().__init__(f"checksum mismatch in block {block} (stripe {stripe}, offset {offset}) "
                         f"of layer {layer} expert {expert}")
        self.layer, self.expert, self.block = layer, expert, block


class FileCheckError(StoreError):
    """One of the store's side files (``SIDE_FILES``) is missing or differs from the manifest."""

    def __init__(self, file: str, problem: str) -> None:
        super().__init__(f"file {file} {problem}")
        self.file = file


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def stripe_name(k: int) -> str:
    return f"stripe_{k}.bin"


def file_crc32(path: Path, chunk_bytes: int = 8 << 20) -> tuple[int, int]:
    """(size, CRC-32) of a whole file, read in chunks."""
    size, crc = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            size += len(chunk)
            crc = zlib.crc32(chunk, crc)
    return size, crc


@dataclass(frozen=True)
class TensorEntry:
    name: str  # projection name, e.g. "gate_proj"
    key: str  # checkpoint key it came from
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # byte offset inside the expert's bytes
    nbytes: int


@dataclass(frozen=True)
class ExpertEntry:
    layer: int
    expert: int
    nbytes: int
    first_block: int
    n_blocks: int
    tensors: tuple[TensorEntry, ...]

    def validate(self, where: str) -> None:
        """Unique tensor names; each tensor's bytes match its shape and lie, without overlap,
        inside the expert's bytes."""
        name = f"{where}: layer {self.layer} expert {self.expert}"
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise StoreError(f"{name} lists tensor(s) {', '.join(twice)} more than once")
        for t in self.tensors:
            if not all(isinstance(d, int) and d >= 0 for d in t.shape):
                raise StoreError(f"{name}: tensor {t.name} has a bad shape {list(t.shape)}")
            if t.offset < 0 or t.nbytes < 0 or t.offset + t.nbytes > self.nbytes:
                raise StoreError(f"{name}: tensor {t.name} (offset {t.offset}, {t.nbytes} bytes) "
                                 f"does not lie inside the expert's {self.nbytes} bytes")
            if t.dtype in DTYPE_BYTES:
                want = DTYPE_BYTES[t.dtype] * math.prod(t.shape)
                if t.nbytes != want:
                    raise StoreError(f"{name}: tensor {t.name} is {t.nbytes} bytes, but "
                                     f"{t.dtype} {list(t.shape)} is {want}")
        by_offset = sorted(self.tensors, key=lambda t: (t.offset, t.nbytes))
        for before, after in zip(by_offset, by_offset[1:]):
            if after.offset < before.offset + before.nbytes:
                raise StoreError(f"{name}: tensors {before.name} and {after.name} overlap")


@dataclass(frozen=True)
class FileEntry:
    """A store file outside the stripes, with its size and CRC-32 of its whole contents."""
    name: str
    size: int
    crc32: int


# One row per block read; also the ctypes-compatible op record of the IO engines.
READ_OP_DTYPE = np.dtype([
    ("file_index", np.int32),  # stripe number
    ("buf_index", np.int32),  # arena slot number
    ("file_offset", np.uint64),
    ("buf_offset", np.uint64),  # byte offset inside the slot
    ("length", np.uint32),
    ("result", np.int32),  # bytes read, or -errno
    ("t_submit_ns", np.uint64),
    ("t_complete_ns", np.uint64),
])


@dataclass(frozen=True)
class Manifest:
    format_version: int
    model_family: str
    model_type: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    block_size: int
    parallelism: int
    experts: tuple[ExpertEntry, ...]
    block_crc: tuple[int, ...]
    stripe_sizes: tuple[int, ...]
    files: tuple[FileEntry, ...]  # one per SIDE_FILES name

    def to_json(self) -> dict:
        return {
            "format_version": self.format_version, "model_family": self.model_family,
            "model_type": self.model_type, "num_layers": self.num_layers,
            "moe_layers": list(self.moe_layers), "num_experts": self.num_experts,
            "top_k": self.top_k, "block_size": self.block_size, "alignment": ALIGN,
            "parallelism": self.parallelism, "checksum": "crc32",
            "stripes": [{"file": stripe_name(k), "size": s} for k, s in enumerate(self.stripe_sizes)],
            "non_expert_weights": NON_EXPERT_NAME,
            "files": [{"file": f.name, "size": f.size, "crc32": f.crc32} for f in self.files],
            "experts": [{"layer": e.layer, "expert": e.expert, "nbytes": e.nbytes,
                         "first_block": e.first_block, "n_blocks": e.n_blocks,
                         "tensors": [{"name": t.name, "key": t.key, "dtype": t.dtype,
                                      "shape": list(t.shape), "offset": t.offset,
                                      "nbytes": t.nbytes} for t in e.tensors]}
                        for e in self.experts],
            "block_crc": list(self.block_crc),
        }

    @classmethod
    def from_json(cls, data: dict, where: str) -> "Manifest":
        try:
            version = data["format_version"]
            if version != FORMAT_VERSION:
                raise StoreError(f"{where}: store format version {version} is not supported "
                                 f"(this build reads version {FORMAT_VERSION}); re-run "
                                 f"`flashmoe convert`")
            experts = tuple(
                ExpertEntry(e["layer"], e["expert"], e["nbytes"], e["first_block"], e["n_blocks"],
                            tuple(TensorEntry(t["name"], t["key"], t["dtype"], tuple(t["shape"]),
                                              t["offset"], t["nbytes"]) for t in e["tensors"]))
                for e in data["experts"])
            manifest = cls(version, data["model_family"], data["model_type"],
                           data["num_layers"], tuple(data["moe_layers"]), data["num_experts"],
                           data["top_k"], data["block_size"], data["parallelism"], experts,
                           tuple(data["block_crc"]),
                           tuple(s["size"] for s in data["stripes"]),
                           tuple(FileEntry(f["file"], f["size"], f["crc32"])
                                 for f in data["files"]))
            manifest.validate(where)
        except (KeyError, TypeError) as exc:
            raise StoreError(f"{where}: manifest is malformed (missing or bad {exc})") from None
        return manifest

    def validate(self, where: str) -> None:
        if self.block_size <= 0 or self.block_size % ALIGN or self.parallelism <= 0:
            raise StoreError(f"{where}: bad block_size {self.block_size} or parallelism "
                             f"{self.parallelism}")
        n_blocks, seen = 0, set()
        for e in self.experts:
            if (e.layer, e.expert) in seen:
                raise StoreError(f"{where}: layer {e.layer} expert {e.expert} is listed twice")
            seen.add((e.layer, e.expert))
            if e.first_block != n_blocks or e.n_blocks != -(-e.nbytes // self.block_size):
                raise StoreError(f"{where}: block range of layer {e.layer} expert {e.expert} "
                                 f"is inconsistent")
            e.validate(where)
            n_blocks += e.n_blocks
        if n_blocks != len(self.block_crc):
            raise StoreError(f"{where}: {len(self.block_crc)} checksums for {n_blocks} blocks")
        if len(self.stripe_sizes) != self.parallelism:
            raise StoreError(f"{where}: {len(self.stripe_sizes)} stripes listed, parallelism "
                             f"{self.parallelism}")
        if sorted(f.name for f in self.files) != sorted(SIDE_FILES):
            raise StoreError(f"{where}: files listed are {[f.name for f in self.files]}, "
                             f"expected {list(SIDE_FILES)}")

    @property
    def max_expert_bytes(self) -> int:
        return max(e.nbytes for e in self.experts)

    @property
    def slot_bytes(self) -> int:
        """Arena slot size that holds any expert's block reads."""
        return round_up(self.max_expert_bytes, ALIGN)


def block_location(block: int, block_size: int, parallelism: int) -> tuple[int, int]:
    """(stripe, byte offset in the stripe) of a global block."""
    return block % parallelism, (block // parallelism) * block_size


def block_read_len(expert: ExpertEntry, i: int, block_size: int) -> int:
    """Bytes read for the expert's i-th block: valid bytes rounded up to ALIGN."""
    valid = min(block_size, expert.nbytes - i * block_size)
    return round_up(valid, ALIGN)


def expected_stripe_sizes(experts: tuple[ExpertEntry, ...] | list[ExpertEntry], block_size: int,
                          parallelism: int) -> list[int]:
    sizes = [0] * parallelism
    for e in experts:
        for i in range(e.n_blocks):
            stripe, offset = block_location(e.first_block + i, block_size, parallelism)
            sizes[stripe] = max(sizes[stripe], offset + block_read_len(e, i, block_size))
    return sizes


class ExpertStore:
    """An opened store: manifest plus the per-expert block read plans."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self.stripe_paths = [path / stripe_name(k) for k in range(manifest.parallelism)]
        self._index = {(e.layer, e.expert): e for e in manifest.experts}
        self._crc = np.asarray(manifest.block_crc, dtype=np.uint32)
        self._plans = {key: self._plan(e) for key, e in self._index.items()}

    @classmethod
    def open(cls, path: str | os.PathLike) -> "ExpertStore":
        path = Path(path)
        manifest_path = path / MANIFEST_NAME
        if not path.is_dir():
            raise StoreError(f"{path}: no such store folder")
        if not manifest_path.is_file():
            raise StoreError(f"{path}: no {MANIFEST_NAME}; not a store, or its conversion did "
                             f"not finish (run `flashmoe convert` again)")
        try:
            data = json.loads(manifest_path.read_text())
        except ValueError as exc:
            raise StoreError(f"{manifest_path}: not valid JSON: {exc}") from None
        manifest = Manifest.from_json(data, str(manifest_path))
        store = cls(path, manifest)
        store.check_stripe_sizes()
        store.check_file_sizes()
        return store

    def check_stripe_sizes(self) -> None:
        for k, (stripe, expected) in enumerate(zip(self.stripe_paths, self.manifest.stripe_sizes)):
            if not stripe.is_file():
                raise StoreError(f"{self.path}: stripe file {stripe.name} is missing")
            actual = stripe.stat().st_size
            if actual < expected:
                raise StoreError(f"{self.path}: stripe file {stripe.name} is truncated "
                                 f"({actual} bytes, expected {expected})")

    def check_file_sizes(self) -> None:
        for f in self.manifest.files:
            error = self._file_size_error(f)
            if error is not None:
                raise StoreError(f"{self.path}: {error}")

    def _file_size_error(self, f: FileEntry) -> FileCheckError | None:
        try:
            actual = (self.path / f.name).stat().st_size
        except FileNotFoundError:
            return FileCheckError(f.name, "is missing")
        if actual != f.size:
            return FileCheckError(f.name, f"is {actual} bytes, the manifest says {f.size}")
        return None

    def verify_files(self) -> Iterator[FileCheckError]:
        """Check the size and CRC-32 of every side file; yields each bad one."""
        for f in self.manifest.files:
            error = self._file_size_error(f)
            if error is None:
                size, crc = file_crc32(self.path / f.name)
                if (size, crc) != (f.size, f.crc32):
                    error = FileCheckError(f.name, f"does not match its checksum (CRC-32 "
                                                   f"{crc:#010x}, the manifest says "
                                                   f"{f.crc32:#010x})")
            if error is not None:
                yield error

    def _plan(self, e: ExpertEntry) -> np.ndarray:
        m = self.manifest
        ops = np.zeros(e.n_blocks, dtype=READ_OP_DTYPE)
        for i in range(e.n_blocks):
            stripe, offset = block_location(e.first_block + i, m.block_size, m.parallelism)
            ops[i]["file_index"] = stripe
            ops[i]["file_offset"] = offset
            ops[i]["buf_offset"] = i * m.block_size
            ops[i]["length"] = block_read_len(e, i, m.block_size)
        return ops

    def expert(self, layer: int, expert: int) -> ExpertEntry:
        try:
            return self._index[(layer, expert)]
        except KeyError:
            raise KeyError(f"layer {layer} expert {expert} is not in the store") from None

    def keys(self) -> list[tuple[int, int]]:
        return list(self._index)

    def read_ops(self, layer: int, expert: int, slot: int) -> np.ndarray:
        """Block reads that bring one expert into arena slot ``slot`` (a fresh copy)."""
        return self.read_ops_batch([(layer, expert, slot)])[0]

    def read_ops_batch(self, items: list[tuple[int, int, int]]) -> tuple[np.ndarray, list[int]]:
        """The block reads of several (layer, expert, slot) loads in one array, and where each
        load's reads end in it."""
        plans = [self._plans[(layer, expert)] for layer, expert, _ in items]
        ops = np.empty(sum(len(plan) for plan in plans), dtype=plans[0].dtype)
        ends, end = [], 0
        for (_, _, slot), plan in zip(items, plans):
            ops[end:end + len(plan)] = plan
            ops["buf_index"][end:end + len(plan)] = slot
            end += len(plan)
            ends.append(end)
        return ops, ends

    def verify_expert_bytes(self, layer: int, expert: int, data: memoryview) -> None:
        """Raise ChecksumError naming the first bad block of an expert read into ``data``."""
        e = self.expert(layer, expert)
        bs = self.manifest.block_size
        for i in range(e.n_blocks):
            length = block_read_len(e, i, bs)
            if zlib.crc32(data[i * bs:i * bs + length]) != self._crc[e.first_block + i]:
                stripe, offset = block_location(e.first_block + i, bs, self.manifest.parallelism)
                raise ChecksumError(layer, expert, e.first_block + i, stripe, offset)

    def verify(self, progress: Callable[[int], None] | None = None) -> Iterator[StoreError]:
        """Check the side files, then every block with buffered reads; yields each bad file
        (FileCheckError) and each bad block (ChecksumError), first one first. ``progress`` is
        called with each expert's bytes."""
        yield from self.verify_files()
        bs = self.manifest.block_size
        files = [open(p, "rb") for p in self.stripe_paths]
        try:
            for e in self.manifest.experts:
                for i in range(e.n_blocks):
                    block = e.first_block + i
                    stripe, offset = block_location(block, bs, self.manifest.parallelism)
                    length = block_read_len(e, i, bs)
                    files[stripe].seek(offset)
                    data = files[stripe].read(length)
                    if len(data) != length or zlib.crc32(data) != self._crc[block]:
                        yield ChecksumError(e.layer, e.expert, block, stripe, offset)
                if progress:
                    progress(e.nbytes)
        finally:
            for f in files:
                f.close()
