"""Raw safetensors access: tensors as bytes, never converted.

The store must be bit-identical to the checkpoint, and numpy has no bfloat16, so the converter
reads and writes the safetensors container directly (8-byte little-endian header length, a JSON
header of ``{name: {dtype, shape, data_offsets}}``, then the data) instead of going through a
framework.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors file is truncated or malformed."""


@dataclass(frozen=True)
class TensorRef:
    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorRef]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: truncated (no header length)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise SafetensorsError(f"{path}: header length {header_len} exceeds the file")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:
            raise SafetensorsError(f"{path}: header is not JSON: {exc}") from None
    data_start = 8 + header_len
    refs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if info["dtype"] not in DTYPE_BYTES or not 0 <= begin <= end <= size - data_start:
            raise SafetensorsError(f"{path}: tensor {name} has a bad dtype or offsets")
        refs[name] = TensorRef(path, name, info["dtype"], tuple(info["shape"]),
                               data_start + begin, end - begin)
    return refs


def index_checkpoint(folder: Path) -> dict[str, TensorRef]:
    """All tensors of every ``*.safetensors`` file in a checkpoint folder."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SafetensorsError(f"{folder}: no *.safetensors files")
    refs: dict[str, TensorRef] = {}
    for path in files:
        refs.update(read_header(path))
    return refs


class TensorReader:
    """Maps checkpoint files once and hands out tensor bytes as memoryviews."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}

    def view(self, ref: TensorRef) -> memoryview:
        if ref.file not in self._maps:
            with open(ref.file, "rb") as f:
                self._maps[ref.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return memoryview(self._maps[ref.file])[ref.start:ref.start + ref.nbytes]

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()


def write_safetensors(path: Path, tensors: Iterable[tuple[str, str, tuple[int, ...], bytes | memoryview]]) -> None:
    """Write (name, dtype, shape, raw bytes) tuples as one safetensors file."""
    items = list(tensors)
    header, offset = {}, 0
    for name, dtype, shape, data in items:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, _, data in items:
            f.write(data)
