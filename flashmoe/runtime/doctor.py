"""`flashmoe doctor [STORE]`: what the troubleshooting of an SSD-backed expert cache needs,
each check with a verdict (ok / warn / fail) and, where it is not ok, a fix.

Checks: the kernel version, io_uring allowed (``kernel.io_uring_disabled`` and a real
``io_uring_setup`` through the helper, which seccomp would refuse), the helper built,
O_DIRECT on the store's filesystem (a real aligned read of its first stripe), the memlock
limit for registered buffers against the arena, /dev/shm against the arena, the NVMe
power-saving state where sysfs shows it, and the engine the cache manager would run and why.
"""

from __future__ import annotations

import mmap
import os
import platform
import resource
from dataclasses import dataclass
from pathlib import Path

from common.config import FlashMoEConfig

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass
class Check:
    name: str
    verdict: str
    detail: str
    fix: str = ""


def _kernel() -> Check:
    release = platform.release()
    try:
        major, minor = (int(x) for x in release.split(".")[:2])
    except ValueError:
        return Check("kernel", WARN, f"{release}: version not understood")
    if (major, minor) < (5, 10):
        return Check("kernel", WARN, f"{release}: io_uring before 5.10 lacks what the helper "
                     "uses (registered files, IORING_FEAT_NODROP)",
                     "use a 5.10+ kernel (JetPack 5+ ships 5.10), or io.engine=pread")
    return Check("kernel", OK, release)


def _io_uring_sysctl() -> Check:
    path = Path("/proc/sys/kernel/io_uring_disabled")
    if not path.is_file():
        return Check("kernel.io_uring_disabled", OK, "not present (io_uring not switched off)")
    value = path.read_text().strip()
    if value == "0":
        return Check("kernel.io_uring_disabled", OK, "0")
    if value == "1" and os.getuid() == 0:
        return Check("kernel.io_uring_disabled", WARN, "1: only root and the io_uring group "
                     "may use io_uring (this process is root)",
                     "sysctl -w kernel.io_uring_disabled=0 to allow every user")
    return Check("kernel.io_uring_disabled", FAIL, f"{value}: io_uring is refused",
                 "sysctl -w kernel.io_uring_disabled=0 (or run with io.engine=pread)")


def _io_uring_setup() -> Check:
    from services.cache_manager.io_engine import IOEngineError, probe_uring

    try:
        probe_uring()
    except IOEngineError as exc:
        fix = ("flashmoe build-helper" if "not built" in str(exc) or "stale" in str(exc) else
               "allow io_uring_setup/enter/register (docker: the seccomp profile in docker/; "
               "sysctl kernel.io_uring_disabled=0), or run with io.engine=pread")
        return Check("io_uring_setup", FAIL, str(exc), fix)
    return Check("io_uring_setup", OK, "a ring can be set up (helper loads, syscall allowed)")


def _o_direct(store_path: Path | None) -> Check:
    if store_path is None:
        return Check("O_DIRECT", WARN, "no store given: not checked", "flashmoe doctor STORE")
    if not store_path.is_dir():
        return Check("O_DIRECT", WARN, "no store folder: not checked",
                     "flashmoe doctor STORE, the folder of a converted store")
    stripes = sorted(store_path.glob("stripe_*.bin"))
    if not stripes:
        return Check("O_DIRECT", FAIL, f"{store_path}: no stripe files (not a store?)",
                     "flashmoe convert HF_DIR STORE")
    try:
        fd = os.open(stripes[0], os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        return Check("O_DIRECT", FAIL, f"{stripes[0]}: {exc.strerror} (the filesystem does "
                     "not support O_DIRECT: tmpfs, some FUSE and overlay mounts)",
                     "put the store on ext4/xfs/btrfs on the SSD itself")
    try:
        buf = mmap.mmap(-1, 4096)  # page-aligned
        n = os.preadv(fd, [buf], 0)
        buf.close()
    except OSError as exc:
        return Check("O_DIRECT", FAIL, f"an aligned O_DIRECT read failed: {exc.strerror}",
                     "put the store on a filesystem that supports O_DIRECT")
    finally:
        os.close(fd)
    return Check("O_DIRECT", OK, f"{stripes[0].name}: aligned O_DIRECT read of {n} bytes")


def _arena_bytes(config: FlashMoEConfig, store_path: Path | None) -> int | None:
    if store_path is None:
        return None
    from common.store import ExpertStore, StoreError

    from common.arena import arena_bytes

    try:
        with ExpertStore.open(store_path) as store:
            return arena_bytes(store.manifest.slot_bytes, config.cache.capacity_experts)
    except StoreError:  # reported by the store check
        return None


def _store(store_path: Path | None) -> Check | None:
    if store_path is None:
        return None
    from common.store import MANIFEST_NAME, ExpertStore, StoreError

    if not store_path.exists():
        return Check("store", FAIL, f"{store_path}: no such folder",
                     "give the folder of a store made by `flashmoe convert HF_DIR STORE`")
    if not (store_path / MANIFEST_NAME).is_file():
        return Check("store", FAIL, f"{store_path}: not a store (no {MANIFEST_NAME})",
                     f"flashmoe convert HF_DIR {store_path}, or give a converted store's folder")
    try:
        store = ExpertStore.open(store_path)
    except StoreError as exc:
        return Check("store", FAIL, str(exc),
                     f"flashmoe verify {store_path} names every bad block; convert the model "
                     f"again to repair it")
    m = store.manifest
    return Check("store", OK, f"{m.model_family}, {len(m.experts)} experts of up to "
                 f"{m.max_expert_bytes / 1e6:.1f} MB, blocks of {m.block_size // 1024} KiB in "
                 f"{len(store.stripe_paths)} stripes")


def _memlock(arena: int | None) -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", OK, "unlimited")
    need = f" for an arena of {arena / 1e9:.2f} GB" if arena else ""
    if os.getuid() == 0:
        return Check("memlock", OK, f"{soft} bytes, but this process is root (CAP_IPC_LOCK)")
    if arena is None or soft < arena:
        return Check("memlock", WARN, f"{soft} bytes: too little to register the arena as "
                     f"fixed buffers{need}; the engine reads without registered buffers",
                     "ulimit -l unlimited (docker: ulimits: memlock: -1; systemd: "
                     "LimitMEMLOCK=infinity)")
    return Check("memlock", OK, f"{soft} bytes{need}")


def _dev_shm(arena: int | None) -> Check:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as exc:
        return Check("/dev/shm", FAIL, str(exc), "mount a tmpfs on /dev/shm")
    free = st.f_bavail * st.f_frsize
    if arena is None:
        return Check("/dev/shm", OK, f"{free / 1e9:.2f} GB free (no store: arena unknown)")
    if free < arena:
        return Check("/dev/shm", FAIL, f"{free / 1e9:.2f} GB free < the arena's "
                     f"{arena / 1e9:.2f} GB", "mount -o remount,size=NG /dev/shm (docker: "
                     "shm_size), or lower cache.capacity_experts")
    return Check("/dev/shm", OK, f"{free / 1e9:.2f} GB free >= the arena's {arena / 1e9:.2f} GB")


def _nvme_power() -> Check:
    rows = []
    for ctrl in sorted(Path("/sys/class/nvme").glob("nvme*")):
        latency = ctrl / "power" / "pm_qos_latency_tolerance_us"
        state = latency.read_text().strip() if latency.is_file() else "?"
        rows.append(f"{ctrl.name}: pm_qos_latency_tolerance_us={state}")
    apst = Path("/sys/module/nvme_core/parameters/default_ps_max_latency_us")
    if apst.is_file():
        rows.append(f"default_ps_max_latency_us={apst.read_text().strip()}")
    if not rows:
        return Check("NVMe power saving", OK, "no NVMe controller visible (a virtual disk?)")
    deep = apst.is_file() and apst.read_text().strip() not in ("0",)
    if deep:
        return Check("NVMe power saving", WARN, "; ".join(rows) + ": APST may put the SSD to "
                     "sleep between tokens (first-read latency)",
                     "nvme_core.default_ps_max_latency_us=0 on the kernel command line")
    return Check("NVMe power saving", OK, "; ".join(rows))


def _engine(config: FlashMoEConfig, uring: Check) -> Check:
    kind = config.io.engine
    if kind == "pread":
        return Check("engine", OK, "pread (io.engine=pread)")
    if uring.verdict == OK:
        return Check("engine", OK, f"uring (io.engine={kind})")
    if kind == "uring":
        return Check("engine", FAIL, f"io.engine=uring but {uring.detail}", uring.fix)
    return Check("engine", WARN, f"pread, because {uring.detail}", uring.fix)


def doctor(config: FlashMoEConfig, store_path: str | None = None) -> list[Check]:
    path = Path(store_path) if store_path else None
    arena = _arena_bytes(config, path)
    uring = _io_uring_setup()
    checks = [_kernel(), _io_uring_sysctl(), uring, _store(path), _o_direct(path),
              _memlock(arena), _dev_shm(arena), _nvme_power(), _engine(config, uring)]
    return [c for c in checks if c is not None]


def format_checks(checks: list[Check]) -> str:
    rows = []
    for c in checks:
        rows.append(f"[{c.verdict:>4}] {c.name:<26} {c.detail}")
        if c.fix and c.verdict != OK:
            rows.append(f"       {'':<26} fix: {c.fix}")
    return "\n".join(rows)
