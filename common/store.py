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

Precision copies (optional): a sub-folder per lower precision (``int8/``, ``int4/``) holds the
same experts quantized (``common/quant.py``), as a store of its own: its ``manifest.json``
(``precision``, ``group_size``, the projections stored transposed, the native manifest's
``source_digest``) and its ``stripe_<k>.bin`` files, blocked, striped and checksummed the same
way. A copy whose digest is not its store's (the native experts were rewritten since) is not
opened. A store without copies works as one with.

Locking: an opened store holds a shared ``flock`` on its manifest (opened read-only, so a
read-only mount works) for as long as the ``ExpertStore`` lives; a writer (``write_lock``)
takes an exclusive non-blocking lock on the folder and on the manifest there is, and refuses
when a running process has the store open. A store being written does not open.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from dataclasses import replace as dataclasses_replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from common.safetensors_io import DTYPE_BYTES
from common.store_errors import (BIG, ChecksumError, FileCheckError, StoreError,  # noqa: F401
                                 _Fields, _short, stripe_name)

FORMAT_VERSION = 2  # 2: sizes and checksums of the non-expert weights and config.json
MANIFEST_NAME = "manifest.json"
NON_EXPERT_NAME = "non_expert.safetensors"
CONFIG_NAME = "config.json"
SIDE_FILES = (NON_EXPERT_NAME, CONFIG_NAME)  # the store's files besides stripes and manifest
ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffers
TENSOR_ALIGN = 256  # alignment of each projection inside an expert's bytes
MAX_MANIFEST_BYTES = 1 << 30  # a manifest larger than this is not one (gpt-oss-20b's: ~2 MB)
CRC_MAX = (1 << 32) - 1
MAX_BLOCK_SIZE = 1 << 30  # a block's read length is a 32-bit field of the IO engines' ops
MAX_COUNT = 1 << 20  # layers of a model, experts of a layer
NATIVE = "native"
COPY_PRECISIONS = ("int8", "int4")  # the lower precisions a store may hold copies of


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


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
    files: tuple[FileEntry, ...]  # one per SIDE_FILES name (none in a precision copy)
    precision: str = NATIVE  # a copy's precision (COPY_PRECISIONS)
    # a copy's quantization: group_size, transposed (projection names), source_digest
    quant: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        copy = {} if self.precision == NATIVE else {"precision": self.precision,
                                                     "quant": self.quant}
        return {**copy, 
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
    def from_json(cls, data: Any, where: str) -> "Manifest":
        """The manifest of a decoded ``manifest.json``; anything malformed (a missing key, a
        value of the wrong type, a negative or non-finite number) is a StoreError."""
        fields = _Fields(data, where, "manifest")
        version = fields.value("format_version")
        if version != FORMAT_VERSION:
            raise StoreError(f"{where}: store format version {_short(version)} is not supported "
                             f"(this build reads version {FORMAT_VERSION}); re-run "
                             f"`flashmoe convert`")
        experts = []
        for i, raw in enumerate(fields.array("experts")):
            e = _Fields(raw, where, f"experts[{i}]")
            tensors = []
            for j, raw_tensor in enumerate(e.array("tensors")):
                t = _Fields(raw_tensor, where, f"experts[{i}].tensors[{j}]")
                # signed: ExpertEntry.validate says what is wrong with a negative one
                tensors.append(TensorEntry(t.text("name"), t.text("key"), t.text("dtype"),
                                           tuple(t.integers("shape", -BIG)),
                                           t.integer("offset", -BIG), t.integer("nbytes", -BIG)))
            experts.append(ExpertEntry(e.integer("layer"), e.integer("expert"),
                                       e.integer("nbytes"), e.integer("first_block"),
                                       e.integer("n_blocks"), tuple(tensors)))
        stripes = [_Fields(raw, where, f"stripes[{k}]").integer("size")
                   for k, raw in enumerate(fields.array("stripes"))]
        files = []
        for k, raw in enumerate(fields.array("files")):
            f = _Fields(raw, where, f"files[{k}]")
            files.append(FileEntry(f.text("file"), f.integer("size"),
                                   f.integer("crc32", hi=CRC_MAX)))
        manifest = cls(version, fields.text("model_family"), fields.text("model_type"),
                       fields.integer("num_layers"), tuple(fields.integers("moe_layers")),
                       fields.integer("num_experts"), fields.integer("top_k"),
                       fields.integer("block_size"), fields.integer("parallelism"),
                       tuple(experts), tuple(fields.integers("block_crc", hi=CRC_MAX)),
                       tuple(stripes), tuple(files))
        if "precision" in data:
            precision = fields.text("precision")
            if precision not in COPY_PRECISIONS:
                raise StoreError(f"{where}: precision {_short(precision)} is not one of "
                                 f"{list(COPY_PRECISIONS)}")
            quant = _Fields(data, where, "manifest").value("quant")
            if not isinstance(quant, dict) or not isinstance(quant.get("transposed"), list) \
                    or not isinstance(quant.get("source_digest"), str) \
                    or not isinstance(quant.get("group_size"), int) \
                    or not 0 < quant["group_size"] <= MAX_COUNT:
                raise StoreError(f"{where}: quant must be an object with group_size, "
                                 f"transposed and source_digest, got {_short(quant)}")
            manifest = dataclasses_replace(manifest, precision=precision, quant=quant)
        manifest.validate(where)
        return manifest

    def validate(self, where: str) -> None:
        if self.block_size <= 0 or self.block_size % ALIGN or self.parallelism <= 0:
            raise StoreError(f"{where}: bad block_size {self.block_size} or parallelism "
                             f"{self.parallelism}")
        if self.block_size > MAX_BLOCK_SIZE:
            raise StoreError(f"{where}: block_size {self.block_size} is over {MAX_BLOCK_SIZE}")
        if not self.experts:
            raise StoreError(f"{where}: lists no experts")
        if not 0 < self.num_layers <= MAX_COUNT or not 0 < self.num_experts <= MAX_COUNT or \
                not 0 <= self.top_k <= self.num_experts:
            raise StoreError(f"{where}: num_layers {self.num_layers}, num_experts "
                             f"{self.num_experts} or top_k {self.top_k} out of range")
        if list(self.moe_layers) != sorted(set(self.moe_layers)) or \
                self.moe_layers[-1:] >= (self.num_layers,):
            raise StoreError(f"{where}: moe_layers {_short(list(self.moe_layers))} must be "
                             f"increasing layer numbers below num_layers {self.num_layers}")
        n_blocks, seen = 0, set()
        for e in self.experts:
            if (e.layer, e.expert) in seen:
                raise StoreError(f"{where}: layer {e.layer} expert {e.expert} is listed twice")
            seen.add((e.layer, e.expert))
            if e.layer not in self.moe_layers or e.expert >= self.num_experts:
                raise StoreError(f"{where}: layer {e.layer} expert {e.expert} lies outside the "
                                 f"MoE layers {list(self.moe_layers)} x {self.num_experts} "
                                 f"experts")
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
        if self.precision != NATIVE:
            if self.files:
                raise StoreError(f"{where}: a precision copy lists side files")
        elif sorted(f.name for f in self.files) != sorted(SIDE_FILES):
            raise StoreError(f"{where}: files listed are {[f.name for f in self.files]}, "
                             f"expected {list(SIDE_FILES)}")

    def digest(self) -> str:
        """A fingerprint of the experts' bytes (their blocks' checksums and layout): a copy
        records its source's and is used only with it."""
        h = zlib.crc32(json.dumps([self.block_size, self.parallelism, [
            [e.layer, e.expert, e.nbytes] for e in self.experts]]).encode())
        h = zlib.crc32(np.asarray(self.block_crc, dtype=np.uint32).tobytes(), h)
        return f"{h:08x}-{len(self.block_crc)}"

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


def store_in_use(path: Path) -> StoreError:
    return StoreError(f"the store at {path} is open by a running FlashMoE process; stop it "
                      f"first")


def _lock(fd: int, kind: int) -> bool:
    """A non-blocking flock of ``kind``; False where another open file holds a conflicting one."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextmanager
def write_lock(path: str | os.PathLike) -> Iterator[None]:
    """Held while a store is written at ``path`` (the folder is made if missing): exclusive
    locks on the folder (one writer at a time) and on the manifest there is (no process has
    the store open). Refuses with a StoreError, without waiting, when either is taken."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fds = [os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        if not _lock(fds[0], fcntl.LOCK_EX):
            raise StoreError(f"the store at {path} is being written by another process "
                             f"(`flashmoe convert` or `synth-store`); wait for it or stop it")
        try:
            fds.append(os.open(path / MANIFEST_NAME, os.O_RDONLY | os.O_CLOEXEC))
        except FileNotFoundError:
            pass  # no manifest: nothing can have the store open
        if len(fds) > 1 and not _lock(fds[1], fcntl.LOCK_EX):
            raise store_in_use(path)
        yield
    finally:
        for fd in fds:
            os.close(fd)


def _read_manifest(path: Path) -> tuple[int, Any]:
    """(a read-only fd of the manifest holding a shared lock, its decoded JSON)."""
    manifest_path = path / MANIFEST_NAME
    try:
        fd = os.open(manifest_path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise StoreError(f"{manifest_path}: cannot be read ({exc.strerror})") from None
    try:
        if not _lock(fd, fcntl.LOCK_SH):
            raise StoreError(f"the store at {path} is being written (`flashmoe convert` or "
                             f"`synth-store`); open it when that has finished")
        if os.fstat(fd).st_ino != os.stat(manifest_path).st_ino:
            raise StoreError(f"the store at {path} was rewritten while it was being opened; "
                             f"open it again")
        size = os.fstat(fd).st_size
        if size > MAX_MANIFEST_BYTES:
            raise StoreError(f"{manifest_path}: {size} bytes is too large for a manifest")
        with os.fdopen(os.dup(fd), "rb") as f:
            text = f.read()
        try:
            return fd, json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise StoreError(f"{manifest_path}: not valid JSON: {_short(exc)}") from None
    except OSError as exc:
        os.close(fd)
        raise StoreError(f"{manifest_path}: cannot be read ({exc.strerror})") from None
    except BaseException:
        os.close(fd)
        raise


class ExpertStore:
    """An opened store: manifest plus the per-expert block read plans. It holds a shared lock
    on the manifest until ``close()`` (or until it is garbage collected): no writer rewrites
    the store meanwhile."""

    def __init__(self, path: Path, manifest: Manifest, lock_fd: int | None = None,
                 file_base: int = 0) -> None:
        self._lock_fd = lock_fd
        self.path = path
        self.manifest = manifest
        self.precision = manifest.precision
        # This store's stripes, then (in the native store) its copies': the IO engine's files.
        # A read op's file_index counts from ``file_base`` (a copy's stripes come after).
        self.file_base = file_base
        self.stripe_paths = [path / stripe_name(k) for k in range(manifest.parallelism)]
        self.copies: dict[str, ExpertStore] = {}  # precision -> its copy, opened
        self.copy_errors: dict[str, str] = {}  # precision -> why its copy was not opened
        self._index = {(e.layer, e.expert): e for e in manifest.experts}
        self._crc = np.asarray(manifest.block_crc, dtype=np.uint32)
        self._plans = {key: self._plan(e) for key, e in self._index.items()}

    @classmethod
    def open(cls, path: str | os.PathLike) -> "ExpertStore":
        path = Path(path)
        if not path.is_dir():
            raise StoreError(f"{path}: no such store folder")
        if not (path / MANIFEST_NAME).is_file():
            raise StoreError(f"{path}: no {MANIFEST_NAME}; not a store, or its conversion did "
                             f"not finish (run `flashmoe convert` again)")
        fd, data = _read_manifest(path)
        try:
            store = cls(path, Manifest.from_json(data, str(path / MANIFEST_NAME)), fd)
        except BaseException:
            os.close(fd)
            raise
        try:
            store.check_stripe_sizes()
            store.check_file_sizes()
            store._open_copies()
        except BaseException:
            store.close()
            raise
        return store

    def _open_copies(self) -> None:
        """Open the precision copies there are; one that is malformed, stale (made from other
        native experts) or cut short is left closed, with the reason in ``copy_errors``."""
        digest = self.manifest.digest()
        base = self.manifest.parallelism
        for precision in COPY_PRECISIONS:
            folder = self.path / precision
            if not (folder / MANIFEST_NAME).is_file():
                continue
            try:
                fd, data = _read_manifest(folder)
            except StoreError as exc:
                self.copy_errors[precision] = str(exc)
                continue
            try:
                m = Manifest.from_json(data, str(folder / MANIFEST_NAME))
                if m.precision != precision:
                    raise StoreError(f"{folder}: holds a {m.precision} copy")
                if m.quant["source_digest"] != digest:
                    raise StoreError(f"{folder}: made from other experts than the store's "
                                     f"(stale); make the copies again (`flashmoe convert "
                                     f"--precisions` or `synth-store --precisions`)")
                if [(e.layer, e.expert) for e in m.experts] != \
                        [(e.layer, e.expert) for e in self.manifest.experts]:
                    raise StoreError(f"{folder}: lists other experts than the store")
                copy = ExpertStore(folder, m, fd, file_base=base)
                fd = None
                copy.check_stripe_sizes()
            except StoreError as exc:
                self.copy_errors[precision] = str(exc)
                if fd is not None:
                    os.close(fd)
                else:
                    copy.close()
                continue
            self.copies[precision] = copy
            self.stripe_paths = self.stripe_paths + copy.stripe_paths
            base += m.parallelism

    @property
    def precisions(self) -> list[str]:
        """The precisions this store can serve: native first, then its opened copies."""
        return [NATIVE, *self.copies]

    def at(self, precision: str) -> "ExpertStore":
        """The store of ``precision`` (this one for native); StoreError if it has no copy."""
        if precision == NATIVE or precision == self.precision:
            return self
        copy = self.copies.get(precision)
        if copy is None:
            why = self.copy_errors.get(precision, "none was made")
            raise StoreError(f"{self.path}: no {precision} copy of the experts ({why}); make "
                             f"one with `flashmoe convert --precisions bf16,int8,int4` or "
                             f"`flashmoe synth-store --precisions int8,int4`")
        return copy

    def close(self) -> None:
        """Release the store's lock (writers may rewrite it from now on)."""
        for copy in getattr(self, "copies", {}).values():
            copy.close()
        fd, self._lock_fd = getattr(self, "_lock_fd", None), None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_stripe_sizes(self) -> None:
        for k, (stripe, expected) in enumerate(zip(self.stripe_paths, self.manifest.stripe_sizes)):
            if not stripe.is_file():
                raise StoreError(f"{self.path}: stripe file {stripe.name} is missing")
            try:
                actual = stripe.stat().st_size
            except OSError as exc:
                raise StoreError(f"{self.path}: stripe file {stripe.name}: {exc.strerror}") \
                    from None
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
        except OSError as exc:
            return FileCheckError(f.name, f"cannot be read ({exc.strerror})")
        if actual != f.size:
            return FileCheckError(f.name, f"is {actual} bytes, the manifest says {f.size}")
        return None

    def verify_files(self) -> Iterator[FileCheckError]:
        """Check the size and CRC-32 of every side file; yields each bad one."""
        for f in self.manifest.files:
            error = self._file_size_error(f)
            if error is None:
                try:
                    size, crc = file_crc32(self.path / f.name)
                except OSError as exc:
                    yield FileCheckError(f.name, f"cannot be read ({exc.strerror})")
                    continue
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
            ops[i]["file_index"] = self.file_base + stripe
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
        """Check the side files, then every block with buffered reads, then the precision
        copies' (a copy that did not open is a StoreError); yields each bad file
        (FileCheckError) and each bad block (ChecksumError), first one first. ``progress`` is
        called with each expert's bytes."""
        yield from self.verify_files()
        yield from self._verify_blocks(progress)
        for precision, why in self.copy_errors.items():
            yield StoreError(f"{precision} copy: {why}")
        for copy in self.copies.values():
            yield from copy._verify_blocks(progress)

    def _verify_blocks(self, progress: Callable[[int], None] | None) -> Iterator[StoreError]:
        bs = self.manifest.block_size
        files = []
        try:
            for p in self.stripe_paths:
                try:
                    files.append(open(p, "rb"))
                except OSError as exc:
                    raise StoreError(f"{self.path}: stripe file {p.name} cannot be read "
                                     f"({exc.strerror})") from None
            for e in self.manifest.experts:
                for i in range(e.n_blocks):
                    block = e.first_block + i
                    stripe, offset = block_location(block, bs, self.manifest.parallelism)
                    length = block_read_len(e, i, bs)
                    try:
                        files[stripe].seek(offset)
                        data = files[stripe].read(length)
                    except OSError as exc:
                        yield ChecksumError(e.layer, e.expert, block, stripe, offset,
                                            f"cannot be read ({exc.strerror})")
                        continue
                    if len(data) != length:
                        yield ChecksumError(e.layer, e.expert, block, stripe, offset,
                                            f"is cut short ({len(data)} of {length} bytes)")
                    elif zlib.crc32(data) != self._crc[block]:
                        yield ChecksumError(e.layer, e.expert, block, stripe, offset)
                if progress:
                    progress(e.nbytes)
        finally:
            for f in files:
                f.close()
