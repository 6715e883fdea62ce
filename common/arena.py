"""The shared-memory expert arena: fixed-size, 4096-aligned slots in one POSIX shm file.

The cache manager creates and owns it (its IO engine reads blocks straight into slots); worker
processes attach read-only and compute from zero-copy numpy / torch views of a slot.
"""

from __future__ import annotations

import mmap
import os
import secrets
import warnings
from pathlib import Path

import numpy as np

from common.store import ALIGN, ExpertEntry, round_up

SHM_DIR = Path("/dev/shm")

# safetensors dtype -> numpy dtype of the same width (bf16 has no numpy type: raw uint16)
NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
                "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I32": np.int32,
                "I64": np.int64, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}


class Arena:
    def __init__(self, name: str, path: Path, mm: mmap.mmap, slot_bytes: int, n_slots: int,
                 owner: bool) -> None:
        self.name, self.path, self.mmap = name, path, mm
        self.slot_bytes, self.n_slots, self.owner = slot_bytes, n_slots, owner
        self.view = memoryview(mm)

    @classmethod
    def create(cls, n_slots: int, slot_bytes: int, prefix: str = "flashmoe") -> "Arena":
        if n_slots < 1:
            raise ValueError("an arena needs at least one slot")
        slot_bytes = round_up(slot_bytes, ALIGN)
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, slot_bytes * n_slots)
            mm = mmap.mmap(fd, slot_bytes * n_slots, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        return cls(name, path, mm, slot_bytes, n_slots, owner=True)

    @classmethod
    def attach(cls, name: str, slot_bytes: int, n_slots: int) -> "Arena":
        """Map an existing arena read-only (worker side)."""
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < slot_bytes * n_slots:
                raise ValueError(f"arena {name} is {size} bytes, expected "
                                 f"{slot_bytes * n_slots}")
            mm = mmap.mmap(fd, slot_bytes * n_slots, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(name, path, mm, slot_bytes, n_slots, owner=False)

    def slot(self, index: int) -> memoryview:
        if not 0 <= index < self.n_slots:
            raise IndexError(f"slot {index} out of range [0, {self.n_slots})")
        return self.view[index * self.slot_bytes:(index + 1) * self.slot_bytes]

    def numpy_views(self, index: int, entry: ExpertEntry) -> dict[str, np.ndarray]:
        """Each projection of the expert in slot ``index`` as a numpy array (no copy)."""
        data = self.slot(index)
        return {t.name: np.frombuffer(data, dtype=NUMPY_DTYPES[t.dtype],
                                      count=int(np.prod(t.shape)), offset=t.offset).reshape(t.shape)
                for t in entry.tensors}

    def torch_views(self, index: int, entry: ExpertEntry) -> dict:
        """Each projection as a torch tensor of its real dtype (bf16 included), no copy."""
        import torch

        dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32,
                  "I64": torch.int64, "I16": torch.int16}
        data = self.slot(index)
        out = {}
        with warnings.catch_warnings():
            # The worker's mapping is read-only on purpose; torch warns about that.
            warnings.simplefilter("ignore", UserWarning)
            for t in entry.tensors:
                count = int(np.prod(t.shape))
                out[t.name] = torch.frombuffer(data, dtype=dtypes[t.dtype], count=count,
                                               offset=t.offset).view(t.shape)
        return out

    def close(self) -> None:
        self.view.release()
        try:
            self.mmap.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping goes with the process
        if self.owner:
            self.path.unlink(missing_ok=True)
