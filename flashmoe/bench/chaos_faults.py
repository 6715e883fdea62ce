"""The faults of `flashmoe chaos`, one ``Fault`` each, in ``FAULTS`` (the matrix's row order).

A fault may put variables in the target's environment from its start (``env``), add settings
(``settings``), act at a random moment under load (``inject``, which may block for as long as
the fault lasts and returns the moment the fault began), prove that it took effect
(``took_effect``: a fault the target did not feel is a failed run, not a passed one) and add a
recovery condition of its own (``recovered``); each is called with the run
(``chaos_run.ChaosRun``, which imports this module, not the other way round). Only the
processes a fault ends (``replaces``) may be restarted: any other service that exits meanwhile
fails the run (a bad block must cost a request, a lost peer a reconnection, not a process).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Callable

from common.bus import ServiceUnavailable, stats
from flashmoe.bench.chaos_procs import SHM_DIR, ThrottledReads

EIO_EVERY = 10  # FMIO_FAULT=eio:N: every N-th read fails with EIO
FREEZE_PAST_HEARTBEAT_S = 2.0  # a frozen worker stays stopped this long past the timeout
REDIS_DOWN_S = 3.0
SLOW_READ_TIMES = 4  # a throttled read of one expert lasts this many read timeouts
CHECKPOINT_EVERY_S = 1.0  # predictor.checkpoint_every_s of the enospc-checkpoint row


@dataclass(frozen=True)
class Fault:
    name: str
    help: str
    inject: Callable[..., float] | None = None
    env: dict[str, str] = field(default_factory=dict)
    settings: tuple[str, ...] = ()
    took_effect: Callable[..., str | None] = lambda run: None
    recovered: Callable[..., bool] = lambda run: True
    replaces: tuple[str, ...] = ()  # roles the fault ends (every other one must live on)
    api_down_expected: bool = False  # serve's API process itself is the victim
    degrades: bool = False  # serve may answer without a bad expert (declared, not compared)
    needs_redis: bool = False
    own_disk: bool = False  # the store copy on a block device of its own (``LoopDisk``)


def kill(role: str) -> Callable[..., float]:
    def inject(run) -> float:
        victim = run.tree.service(role)
        if victim is None:
            raise RuntimeError(f"no {role} process to kill")
        run.victim = victim
        run.tree.signal(victim, signal.SIGKILL)
        return time.monotonic()
    return inject


def killed_and_replaced(run) -> str | None:
    role = run.victim.role
    now = run.tree.service(role)
    if now is None or now.pid == run.victim.pid:
        return f"the killed {role} (pid {run.victim.pid}) was not replaced"
    return None


def corrupt_block(run) -> float:
    """Flip bytes of the focus expert's first block in the target's copy of the store."""
    import os

    from common.store import block_location

    store = run.truth.store
    layer, expert = run.verifier.focus
    e, m = store.expert(layer, expert), store.manifest
    stripe, offset = block_location(e.first_block, m.block_size, m.parallelism)
    path = run.store_copy / store.stripe_paths[stripe].name
    fd = os.open(path, os.O_RDWR)
    try:
        at = offset + min(64, e.nbytes // 2)
        data = bytes(b ^ 0xFF for b in os.pread(fd, 16, at))
        os.pwrite(fd, data, at)
        os.fsync(fd)
    finally:
        os.close(fd)
    run.event(f"flipped 16 bytes of layer {layer} expert {expert} (stripe {stripe}, offset {at})")
    return time.monotonic()


def load_errors_seen(run) -> str | None:
    if not any(n.startswith("ExpertLoadError") for n in run.verifier.out.notes):
        return "the verifier never got an ExpertLoadError: the fault did not reach a load"
    return None


def reads_failed(run) -> str | None:
    """The eio fault: reads failed (and were read again, so no request need have failed)."""
    try:
        counters = stats(run.control("cache_manager"), timeout_s=2.0)
    except ServiceUnavailable as exc:
        return f"the cache manager's stats did not answer: {exc}"
    if not counters.get("n_io_error"):
        return "the cache manager counted no failed read: the fault did not reach a load"
    return None


def remove_arena(run) -> float:
    manager = run.tree.service("cache_manager")
    arenas = [p for p in SHM_DIR.glob(f"flashmoe-{manager.pid}-*")] if manager else []
    if not arenas:
        raise RuntimeError("the cache manager's arena is not in /dev/shm")
    run.victim = manager
    for path in arenas:
        path.unlink()
    run.event(f"removed {', '.join(p.name for p in arenas)}")
    return time.monotonic()


def slow_reads(run) -> float:
    """Move the cache manager into a blkio cgroup whose reads of the store's disk are so slow
    that one expert's read outlasts ``io.read_timeout_s`` several times; its restarted
    successor (a child of the supervisor, outside the group) reads at full speed. The store
    copy is on a loop device of its own (``own_disk``): the throttle slows the store, not the
    program's own files."""
    manager = run.tree.service("cache_manager")
    if manager is None:
        raise RuntimeError("no cache manager to slow down")
    e = max(run.truth.store.manifest.experts, key=lambda x: x.nbytes)
    bps = max(512, int(e.nbytes / (SLOW_READ_TIMES * run.read_timeout_s)))
    run.throttle = ThrottledReads(run.store_copy / run.truth.store.stripe_paths[0].name, bps)
    run.throttle.add(manager.pid)
    run.victim = manager
    run.event(f"cache manager {manager.pid} reads at {bps} B/s")
    return time.monotonic()


def manager_replaced(run) -> str | None:
    now = run.tree.service("cache_manager")
    if now is None or now.pid == run.victim.pid:
        return f"the cache manager {run.victim.pid} was not replaced"
    return None


def manager_back(run) -> bool:
    """Recovered only once the cache manager the fault hit was replaced by a new one."""
    return manager_replaced(run) is None


def freeze_worker(run) -> float:
    worker = run.tree.service("worker")
    if worker is None:
        raise RuntimeError("no worker to freeze")
    run.victim = worker
    run.tree.signal(worker, signal.SIGSTOP)
    began = time.monotonic()
    time.sleep(run.heartbeat_timeout_s + FREEZE_PAST_HEARTBEAT_S)
    run.tree.signal(worker, signal.SIGCONT)
    return began


def restart_redis(run) -> float:
    began = time.monotonic()
    run.redis.stop(kill=True)
    deadline = began + REDIS_DOWN_S
    while time.monotonic() < deadline:
        run.sample_cluster(outage=True)
        time.sleep(0.25)
    run.redis.start()
    run.redis_back = time.monotonic()
    return began


def redis_outage_seen(run) -> str | None:
    if not run.cluster_outage_seen:
        return "no service reported losing Redis while it was down"
    return None


def cluster_connected_again(run) -> bool:
    return run.cluster_connected_since(run.redis_back)


def no_checkpoint_written(run) -> str | None:
    written = [p for folder in run.checkpoint_dirs() for p in folder.glob("*.safetensors")]
    if written:
        return (f"a checkpoint was written ({written[0]}): FLASHMOE_CHECKPOINT_FAULT=enospc "
                f"was not honoured")
    return None


def wait_checkpoints(run) -> float:
    """The fault is on from the start: let a few checkpoint periods pass under load."""
    time.sleep(3 * CHECKPOINT_EVERY_S)
    return time.monotonic()


def under_load(run) -> float:
    return time.monotonic()


FAULTS = (
    Fault("kill-cache_manager", "kill -9 the cache manager", kill("cache_manager"),
          took_effect=killed_and_replaced, replaces=("cache_manager",)),
    Fault("kill-feature_extractor", "kill -9 the feature extractor", kill("feature_extractor"),
          took_effect=killed_and_replaced, replaces=("feature_extractor",)),
    Fault("kill-predictor", "kill -9 the predictor", kill("predictor"),
          took_effect=killed_and_replaced, replaces=("predictor",)),
    Fault("kill-panel", "kill -9 the control panel", kill("panel"),
          took_effect=killed_and_replaced, replaces=("panel",)),
    Fault("kill-worker", "kill -9 the worker (run: the trace worker; serve: the API worker)",
          kill("worker"), took_effect=killed_and_replaced, replaces=("worker",),
          api_down_expected=True),
    Fault("corrupt-block", "flip bytes of one expert's block in the target's store copy",
          corrupt_block, took_effect=load_errors_seen, degrades=True),
    Fault("eio", f"every {EIO_EVERY}th read fails with EIO (FMIO_FAULT=eio:{EIO_EVERY})",
          under_load, env={"FMIO_FAULT": f"eio:{EIO_EVERY}"}, took_effect=reads_failed),
    Fault("slow-read", "the cache manager's reads of the store throttled (blkio cgroup on the "
                       "store's own loop device) past io.read_timeout_s", slow_reads,
          took_effect=manager_replaced, recovered=manager_back, replaces=("cache_manager",),
          own_disk=True),
    Fault("enospc-checkpoint", "every checkpoint write fails with ENOSPC "
                               "(FLASHMOE_CHECKPOINT_FAULT=enospc)", wait_checkpoints,
          env={"FLASHMOE_CHECKPOINT_FAULT": "enospc"},
          settings=(f"predictor.checkpoint_every_s={CHECKPOINT_EVERY_S:g}",),
          took_effect=no_checkpoint_written),
    Fault("arena-removed", "remove the cache manager's arena file from /dev/shm", remove_arena,
          took_effect=manager_replaced, recovered=manager_back, replaces=("cache_manager",)),
    Fault("redis-restart", "restart the cluster's redis-server", restart_redis,
          settings=("cluster.backoff_max_s=1", "cluster.publish_every_s=1",
                    "cluster.timeout_s=0.5"),
          took_effect=redis_outage_seen, recovered=cluster_connected_again, needs_redis=True),
    Fault("frozen-worker", "SIGSTOP the worker past the heartbeat timeout, then SIGCONT",
          freeze_worker),
)
FAULT_NAMES = tuple(f.name for f in FAULTS)
