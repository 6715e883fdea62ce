"""The shared-memory expert arena: fixed-size, 4096-aligned slots in one POSIX shm file.

The cache manager creates and owns it (its IO engine reads blocks straight into slots); worker
processes attach read-only and compute from zero-copy numpy / torch views of a slot.

After the slots, one uint64 per slot counts the loads into it (``generations``): the owner
bumps a slot's count before each read into it, so a worker that noted the counts of its slots
when it acquired them can tell, locally and exactly, whether any of them has been given to
another expert since (``CacheClient.lost``).

An arena is named ``<prefix>-<owner pid>-<8 hex digits>``, and its owner holds an exclusive
``flock`` on it for its life: ``sweep_stale_arenas`` removes the arenas a crashed owner left
behind, and the lock keeps it off the live arena of an owner whose pid it cannot see (another
PID namespace: containers sharing /dev/shm).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.config import PRECISION_SPLIT
from common.quant import PRECISIONS
from common.store import ALIGN, ExpertEntry, round_up

SHM_DIR = Path("/dev/shm")

# safetensors dtype -> numpy dtype of the same width (bf16 has no numpy type: raw uint16)
NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
                "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I32": np.int32,
                "I64": np.int64, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}

NAME_CHARS = re.compile(r"[A-Za-z0-9._-]+")


class ArenaSpaceError(OSError):
    """/dev/shm has too little free space for the arena."""


def check_arena_name(name: str) -> None:
    """Refuse a name that is not one plain file name in SHM_DIR; the ValueError says why."""
    if "/" in name or os.sep in name:
        raise ValueError(f"arena name {name!r} contains a path separator")
    if ".." in name:
        raise ValueError(f"arena name {name!r} contains '..'")
    if not NAME_CHARS.fullmatch(name):
        raise ValueError(f"arena name {name!r} is empty or has characters outside "
                         f"[A-Za-z0-9._-]")
    if name == ".":
        raise ValueError("arena name '.' names the shared-memory folder itself")


def _stale_owner(name: str, prefix: str) -> bool:
    """Does the name have the form of an arena of ``prefix`` whose owner pid is gone?"""
    match = re.fullmatch(re.escape(prefix) + r"(?:-.+)?-([0-9]+)-[0-9a-f]{8}", name)
    if match is None:
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False  # alive under another user / not a pid
    return False


def sweep_stale_arenas(prefix: str = "flashmoe") -> list[str]:
    """Remove the arenas of ``prefix`` left in SHM_DIR by owners that died; returns their names.

    Only files named ``<prefix>[-anything]-<pid>-<8 hex digits>`` are looked at, and one is
    removed only if that pid is not alive and nobody holds its owner lock."""
    removed = []
    for path in sorted(SHM_DIR.iterdir()):
        if not _stale_owner(path.name, prefix):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone already, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                path.unlink()
                removed.append(path.name)
        except OSError:
            pass  # locked by a live owner, replaced or removed meanwhile, or not ours
        finally:
            os.close(fd)
    return removed


def _reserve(fd: int, size: int) -> None:
    """Allocate the arena's memory now: a /dev/shm too small fails here, not as a SIGBUS on
    the first touch of a slot."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        os.ftruncate(fd, 0)  # give back any part allocated, so the free space below is true
        fs = os.statvfs(SHM_DIR)
        raise ArenaSpaceError(
            exc.errno, f"{SHM_DIR} has too little free space for the expert arena: "
            f"{size} bytes ({size / 2**30:.2f} GiB) wanted, {fs.f_bavail * fs.f_frsize} bytes "
            f"({fs.f_bavail * fs.f_frsize / 2**30:.2f} GiB) free of "
            f"{fs.f_blocks * fs.f_frsize / 2**30:.2f} GiB; lower cache.capacity_experts or give "
            f"{SHM_DIR} more room (docker: shm_size)") from None


def arena_bytes(slot_bytes: int, n_slots: int) -> int:
    """The arena file's size: the slots, then the slots' load counts (page-rounded)."""
    return slot_bytes * n_slots + round_up(8 * n_slots, ALIGN)


class Arena:
    def __init__(self, name: str, path: Path, mm: mmap.mmap, slot_bytes: int, n_slots: int,
                 owner: bool, lock_fd: int | None = None) -> None:
        self.name, self.path, self.mmap = name, path, mm
        self.slot_bytes, self.n_slots, self.owner = slot_bytes, n_slots, owner
        self.view = memoryview(mm)
        # Loads into each slot so far (the owner bumps them; see the module docstring).
        start = slot_bytes * n_slots
        self.generations = self.view[start:start + 8 * n_slots].cast("Q")
        self._lock_fd = lock_fd  # the owner's open file, flock-ed while the arena lives
        # slots by precision (the owner's plan, or a Ready message's): one native pool of
        # one-unit slots unless set
        self.layout = ArenaLayout(slot_bytes, (Pool("native", 0, n_slots, 1),))

    @classmethod
    def create(cls, n_slots: int, slot_bytes: int, prefix: str = "flashmoe") -> "Arena":
        if n_slots < 1:
            raise ValueError("an arena needs at least one slot")
        slot_bytes = round_up(slot_bytes, ALIGN)
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        size = arena_bytes(slot_bytes, n_slots)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            _reserve(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            path.unlink(missing_ok=True)
            os.close(fd)
            raise
        return cls(name, path, mm, slot_bytes, n_slots, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str, slot_bytes: int, n_slots: int) -> "Arena":
        """Map an existing arena read-only (worker side)."""
        check_arena_name(name)
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDONLY)
        try:
            size, expected = os.fstat(fd).st_size, arena_bytes(slot_bytes, n_slots)
            if size < expected:
                raise ValueError(f"arena {name} is {size} bytes, expected {expected}")
            mm = mmap.mmap(fd, expected, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(name, path, mm, slot_bytes, n_slots, owner=False)

    def missing(self) -> str | None:
        """Owner side: why the arena's /dev/shm file is no longer this arena (removed, e.g. by
        systemd's ``RemoveIPC=yes``, or replaced by another file), or None while it is. New
        workers attach by name, so a missing file means none can."""
        if self._lock_fd is None:
            return "the arena is closed"
        try:
            if os.path.samestat(os.fstat(self._lock_fd), os.lstat(self.path)):
                return None
        except FileNotFoundError:
            return f"{self.path} was removed"
        return f"{self.path} was replaced by another file"

    def slot(self, index: int) -> memoryview:
        if not 0 <= index < self.n_slots:
            raise IndexError(f"slot {index} out of range [0, {self.n_slots})")
        return self.view[index * self.slot_bytes:(index + 1) * self.slot_bytes]

    def span(self, index: int, nbytes: int) -> memoryview:
        """``nbytes`` from the start of slot ``index`` on (a slot of several units)."""
        start = index * self.slot_bytes
        if not 0 <= index < self.n_slots or start + nbytes > self.slot_bytes * self.n_slots:
            raise IndexError(f"{nbytes} bytes at slot {index} lie outside the arena")
        return self.view[start:start + nbytes]

    def numpy_views(self, index: int, entry: ExpertEntry) -> dict[str, np.ndarray]:
        """Each projection of the expert in slot ``index`` as a numpy array (no copy)."""
        data = self.span(index, entry.nbytes)  # (a slot may span several units)
        return {t.name: np.frombuffer(data, dtype=NUMPY_DTYPES[t.dtype],
                                      count=int(np.prod(t.shape)), offset=t.offset).reshape(t.shape)
                for t in entry.tensors}

    def torch_views(self, index: int, entry: ExpertEntry) -> dict:
        """Each projection as a torch tensor of its real dtype (bf16 included), no copy."""
        return expert_torch_views(self.span(index, entry.nbytes), entry)

    def close(self) -> None:
        self.generations.release()
        self.view.release()
        try:
            self.mmap.close()
        except BufferError:
            pass  # views handed out are still alive; the mapping goes with the process
        if self.owner and self.missing() is None:  # never another's file of the same name
            self.path.unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def expert_torch_views(data, entry: ExpertEntry) -> dict:
    """Each projection of the expert whose bytes ``data`` holds (a buffer starting at the
    expert) as a torch tensor of its real dtype (bf16 included), no copy."""
    import torch

    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32,
              "I64": torch.int64, "I16": torch.int16}
    out = {}
    with warnings.catch_warnings():
        # Read-only mappings (the worker's arena, a memory-mapped file): torch warns.
        warnings.simplefilter("ignore", UserWarning)
        for t in entry.tensors:
            count = int(np.prod(t.shape))
            out[t.name] = torch.frombuffer(data, dtype=dtypes[t.dtype], count=count,
                                           offset=t.offset).view(t.shape)
    return out


# --- the arena's layout by precision ------------------------------------------------------------

@dataclass(frozen=True)
class Pool:
    """The slots of one precision: ``n_slots`` slots of ``units`` consecutive arena units
    each, the first at unit ``first``; a slot is named by its first unit."""
    precision: str
    first: int
    n_slots: int
    units: int

    def slots(self) -> range:
        return range(self.first, self.first + self.n_slots * self.units, self.units)

    def __contains__(self, slot: int) -> bool:
        return self.first <= slot < self.first + self.n_slots * self.units \
            and (slot - self.first) % self.units == 0


@dataclass(frozen=True)
class ArenaLayout:
    """How the arena's units are cut into slots of each precision. One native pool of
    one-unit slots is the layout of a store without copies (``cache.precision = native``)."""
    unit_bytes: int
    pools: tuple[Pool, ...]

    @property
    def n_units(self) -> int:
        last = self.pools[-1]
        return last.first + last.n_slots * last.units

    def pool_of(self, slot: int) -> Pool:
        for pool in self.pools:
            if slot in pool:
                return pool
        raise IndexError(f"slot {slot} is not a slot of the arena's layout")

    def to_wire(self) -> list[list]:
        return [[p.precision, p.first, p.n_slots, p.units] for p in self.pools]

    @classmethod
    def from_wire(cls, unit_bytes: int, n_units: int, pools: list) -> "ArenaLayout":
        """The layout a Ready message describes (no pools: one native pool of every unit);
        ValueError where it does not fit the arena."""
        if not pools:
            return cls(unit_bytes, (Pool("native", 0, n_units, 1),))
        layout = cls(unit_bytes, tuple(Pool(str(p), int(f), int(n), int(u))
                                       for p, f, n, u in pools))
        if layout.n_units > n_units or any(p.n_slots < 0 or p.units < 1 for p in layout.pools):
            raise ValueError(f"pools {pools} do not fit an arena of {n_units} units")
        return layout


def plan_layout(store, capacity_experts: int, precision: str,
                split: tuple[float, float, float] | None = None) -> ArenaLayout:
    """The arena's layout for ``cache.precision``. The budget is ``capacity_experts`` native
    slots' bytes whatever the precision: at ``int8`` or ``int4`` it holds slots of that
    copy's size; ``dynamic`` and ``random`` cut it into native, int8 and int4 pools by the
    byte fractions ``split`` (a precision of fraction 0 gets no pool), each slot a whole
    number of units of the int4 slot's size (a block read that crosses units is cut in two at
    the boundary: cache_manager/loads.py). The store must hold the copies asked for
    (``store.at`` says how to make them)."""
    wanted = {"int8": ("int8",), "int4": ("int4",)}.get(precision, ())
    if precision in ("dynamic", "random"):
        wanted = ("int8", "int4")
    sizes = {"native": store.manifest.slot_bytes,
             **{p: store.at(p).manifest.slot_bytes for p in wanted}}
    return plan_pools(sizes, capacity_experts, precision, split)


def pool_fractions(layout: ArenaLayout, fractions: tuple[float, ...] | None
                   ) -> tuple[float, ...]:
    """``random``'s probability of each pool of ``layout``: from ``fractions`` (one per
    precision, native, int8 and int4, as cache.precision_fractions gives them; a precision
    without a pool is left out), or by default the pools' shares of slots."""
    if fractions is None:
        return tuple(float(p.n_slots) for p in layout.pools)
    by_name = dict(zip(PRECISIONS, fractions))
    return tuple(float(by_name[p.precision]) for p in layout.pools)


def plan_pools(sizes: dict[str, int], capacity_experts: int, precision: str,
               split: tuple[float, float, float] | None = None) -> ArenaLayout:
    """``plan_layout`` from the slot bytes of each precision (``sizes``: native, and the
    copies the precision needs); the simulator's way in. ``split`` None: the default."""
    split = PRECISION_SPLIT if split is None else split
    native_slot = sizes["native"]
    budget = capacity_experts * native_slot
    if precision == "native":
        return ArenaLayout(native_slot, (Pool("native", 0, capacity_experts, 1),))
    if precision in ("int8", "int4"):
        unit = sizes[precision]
        return ArenaLayout(unit, (Pool(precision, 0, max(1, budget // unit), 1),))
    if precision not in ("dynamic", "random"):
        raise ValueError(f"cache.precision {precision!r}: one of native, int8, int4, dynamic, "
                         f"random")
    unit = sizes["int4"]
    pools, first = [], 0
    for name, share in zip(PRECISIONS, split):
        if share <= 0:
            continue  # no pool of that precision
        units = -(-sizes[name] // unit)
        n = max(1, int(share * budget) // (units * unit))
        pools.append(Pool(name, first, n, units))
        first += n * units
    return ArenaLayout(unit, tuple(pools))
