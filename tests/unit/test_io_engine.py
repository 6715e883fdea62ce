"""IO engines: asynchronous submit / reap through the completion fd, bounded depth, exact bytes;
the synchronous read() on top; auto falls back to pread with a reason. Every test runs on both
engines; the io_uring variant skips with the reason where the helper or io_uring is missing."""

import errno
import logging
import select

import numpy as np
import pytest

from common.arena import Arena
from common.store import ExpertStore
from services.cache_manager import io_engine
from services.cache_manager.io_engine import (IOEngine, IOEngineError, IOFaults, PreadEngine,
                                              UringEngine, open_engine, parse_fault_spec)
from tests.support.uring import uring_available

URING_OK, URING_WHY = uring_available()
KINDS = ["pread", pytest.param("uring", marks=pytest.mark.uring)]
N_SLOTS = 8


@pytest.fixture
def store_and_arena(tiny_store):
    store = ExpertStore.open(tiny_store)
    arena = Arena.create(N_SLOTS, store.manifest.slot_bytes)
    yield store, arena
    arena.close()


@pytest.fixture
def open_kind(store_and_arena):
    """open_kind(kind, depth) -> engine; closed at teardown. uring skips when unavailable."""
    store, arena = store_and_arena
    opened = []

    def open_(kind: str, depth: int):
        if kind == "uring" and not URING_OK:
            pytest.skip(f"io_uring helper unavailable: {URING_WHY}")
        engine, reason = open_engine(kind, arena.mmap, arena.slot_bytes, N_SLOTS,
                                     store.stripe_paths, depth)
        assert engine.name == kind and reason == ""
        opened.append(engine)
        return engine

    yield open_
    for engine in opened:
        engine.close()


def reap_all(engine, expected: set[int], timeout_s: float = 30.0) -> dict[int, np.ndarray]:
    """Wait on the engine's fd and reap until every expected batch is back; checks that no more
    than depth reads are ever in flight."""
    poller = select.poll()
    poller.register(engine.fileno(), select.POLLIN)
    done = {}
    for _ in range(int(timeout_s / 0.05)):
        assert engine.inflight() <= engine.depth
        for batch_id, ops in engine.reap():
            done[batch_id] = ops
        if expected <= done.keys():
            return done
        poller.poll(50)
    raise AssertionError(f"batches {sorted(expected - done.keys())} never completed")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth", [1, 4, 32])
def test_read_fills_slots_with_the_stores_bytes(store_and_arena, open_kind, kind, depth):
    store, arena = store_and_arena
    engine = open_kind(kind, depth)
    keys = store.keys()[:4]
    ops = np.concatenate([store.read_ops(l, e, slot) for slot, (l, e) in enumerate(keys)])
    engine.read(ops)
    assert (ops["result"] == ops["length"]).all()
    assert (ops["t_complete_ns"] >= ops["t_submit_ns"]).all() and (ops["t_submit_ns"] > 0).all()
    for slot, (l, e) in enumerate(keys):
        store.verify_expert_bytes(l, e, arena.slot(slot))
    assert engine.inflight() == engine.queued() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_many_batches_submitted_without_waiting_are_reaped_through_the_fd(
        store_and_arena, open_kind, kind):
    store, arena = store_and_arena
    engine = open_kind(kind, 2)  # far fewer than the reads submitted: the queue refills
    keys = store.keys()[:N_SLOTS]
    batches = {}
    for slot, key in enumerate(keys):
        ops = store.read_ops(*key, slot)
        batches[engine.submit(ops)] = (key, slot, ops)
        assert engine.inflight() <= 2
    assert len(batches) == N_SLOTS
    done = reap_all(engine, set(batches))
    assert done.keys() == batches.keys()
    for batch_id, (key, slot, ops) in batches.items():
        assert done[batch_id] is ops  # the caller's records, filled in place
        assert (ops["result"] == ops["length"]).all()
        store.verify_expert_bytes(*key, arena.slot(slot))
    assert engine.inflight() == engine.queued() == 0 and engine.oldest_inflight_s() is None
    assert engine.reap() == []
    assert engine.stats["stale"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_invalid_ops_fail_alone(store_and_arena, open_kind, kind):
    store, arena = store_and_arena
    engine = open_kind(kind, 2)
    keys = store.keys()[:2]
    ops = np.concatenate([store.read_ops(*keys[0], slot=0), store.read_ops(*keys[1], slot=1)])
    ops[0]["buf_index"] = 99
    ops[1]["file_index"] = 7
    ops[2]["buf_offset"] = arena.slot_bytes  # past the slot's end
    engine.read(ops)
    assert list(ops["result"][:3]) == [-errno.EINVAL] * 3
    assert (ops[3:]["result"] == ops[3:]["length"]).all()
    store.verify_expert_bytes(*keys[1], arena.slot(1))
    # A batch with nothing valid completes at once and still comes back through reap.
    bad = store.read_ops(*keys[0], slot=0)
    bad["length"] = 0
    batch_id = engine.submit(bad)
    assert reap_all(engine, {batch_id})[batch_id] is bad
    assert (bad["result"] == -errno.EINVAL).all()


@pytest.mark.parametrize("kind", KINDS)
def test_read_leaves_other_batches_to_reap(store_and_arena, open_kind, kind):
    store, arena = store_and_arena
    engine = open_kind(kind, 4)
    keys = store.keys()[:2]
    first = store.read_ops(*keys[0], slot=0)
    first_id = engine.submit(first)
    second = store.read_ops(*keys[1], slot=1)
    engine.read(second)
    assert (second["result"] == second["length"]).all()
    done = reap_all(engine, {first_id})
    assert list(done) == [first_id] and (first["result"] == first["length"]).all()
    store.verify_expert_bytes(*keys[0], arena.slot(0))


def test_read_keeps_batches_reaped_in_the_same_call_as_its_own():
    """read() may reap its own batch ahead of others in one call; those stay for reap()."""

    class Scripted(io_engine.EngineBase):
        name = "scripted"

        def __init__(self):
            super().__init__(depth=1, drain_timeout_s=1.0)
            self.ready = []

        def submit(self, ops):
            self.ready = [(2, ops), (1, "first")]
            return 2

        def fileno(self):
            return 0

        def _closed(self):
            return False

        def _reap_ready(self):
            ready, self.ready = self.ready, []
            return ready

    engine = Scripted()
    engine.read(np.zeros(1, io_engine.READ_OP_DTYPE))
    assert engine.reap() == [(1, "first")] and engine.reap() == []


@pytest.mark.parametrize("engine_class", [PreadEngine, UringEngine])
def test_both_engines_have_the_whole_interface(engine_class):
    members = {name for name in dir(IOEngine) if not name.startswith("_")}
    members |= set(IOEngine.__annotations__) - {"direct", "depth", "drain_timeout_s"}  # per instance
    assert {m for m in members if not hasattr(engine_class, m)} == set()


def test_fault_spec_parses_and_rejects_unknown_kinds():
    assert parse_fault_spec("delay:5, short_read:3") == [("delay", 5), ("short_read", 3)]
    assert parse_fault_spec("") == []
    for bad in ("explode:1", "delay", "delay:-1", "delay:x"):
        with pytest.raises(IOEngineError, match="FMIO_FAULT"):
            parse_fault_spec(bad)


def test_faults_are_a_declared_setting_read_from_the_env():
    faults = IOFaults.from_env({"FMIO_FAULT": "short_read:3,delay:5,delay:7"})
    assert faults == IOFaults(delay=7, short_read=3)
    assert faults.items() == [("delay", 7), ("short_read", 3)]
    assert faults.spec() == "delay:7,short_read:3" and IOFaults.parse(faults.spec()) == faults
    assert IOFaults.from_env({}).items() == []


@pytest.mark.parametrize("kind", KINDS)
def test_fmio_fault_env_arms_faults_loudly(store_and_arena, open_kind, kind, monkeypatch,
                                           caplog):
    monkeypatch.setenv("FMIO_FAULT", "delay:5,short_read:3")
    with caplog.at_level(logging.WARNING):
        engine = open_kind(kind, 2)
    assert engine.stats["faults"] == {"delay": 5, "short_read": 3}
    assert "FMIO_FAULT" in caplog.text and "testing only" in caplog.text
    monkeypatch.setenv("FMIO_FAULT", "explode:1")
    with pytest.raises(IOEngineError, match="explode"):
        open_kind(kind, 2)


@pytest.mark.uring
def test_uring_helper_loads_and_rings_are_allowed_here():
    if not URING_OK:
        pytest.skip(f"io_uring helper unavailable: {URING_WHY}")
    assert io_engine.HELPER_LIBRARY.exists()
    io_engine.probe_uring()


def test_auto_falls_back_to_pread_with_reason(store_and_arena, monkeypatch, tmp_path):
    store, arena = store_and_arena
    monkeypatch.setattr(io_engine.uring, "HELPER_LIBRARY", tmp_path / "missing.so")
    engine, reason = open_engine("auto", arena.mmap, arena.slot_bytes, N_SLOTS,
                                 store.stripe_paths, 4)
    try:
        assert engine.name == "pread" and "not built" in reason
    finally:
        engine.close()
    with pytest.raises(IOEngineError, match="not built"):
        open_engine("uring", arena.mmap, arena.slot_bytes, N_SLOTS, store.stripe_paths, 4)
    with pytest.raises(IOEngineError, match="unknown IO engine"):
        open_engine("spdk", arena.mmap, arena.slot_bytes, N_SLOTS, store.stripe_paths, 4)


# A child that may pin only 64 KiB: as root it first loses CAP_IPC_LOCK (which lifts the
# limit), as another user the limit alone holds.
_LOW_MEMLOCK_CHILD = r"""
import resource, sys
import numpy as np
from common.arena import Arena
from common.store import ExpertStore
from services.cache_manager.io_engine import open_engine

resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))
store = ExpertStore.open(sys.argv[1])
arena = Arena.create(8, store.manifest.slot_bytes)
engine, reason = open_engine("uring", arena.mmap, arena.slot_bytes, 8, store.stripe_paths, 4)
keys = store.keys()[:4]
ops = np.concatenate([store.read_ops(l, e, slot) for slot, (l, e) in enumerate(keys)])
engine.read(ops)
for slot, (l, e) in enumerate(keys):
    store.verify_expert_bytes(l, e, arena.slot(slot))
print(engine.name, int(engine.fixed_buffers), engine.fixed_buffers_reason)
engine.close()
arena.close()
"""


@pytest.mark.uring
def test_uring_reads_into_unregistered_slots_where_memlock_is_too_low(tiny_store):
    """A container that may not raise RLIMIT_MEMLOCK still gets io_uring with O_DIRECT: the
    arena is not registered as fixed buffers, the reads land in its slots all the same, and
    the engine says so."""
    if not URING_OK:
        pytest.skip(f"io_uring helper unavailable: {URING_WHY}")
    import os
    import shutil
    import subprocess
    import sys

    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root keeps CAP_IPC_LOCK without setpriv (util-linux)")
        prefix = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"]
    result = subprocess.run([*prefix, sys.executable, "-c", _LOW_MEMLOCK_CHILD, str(tiny_store)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    name, fixed, reason = result.stdout.strip().split(" ", 2)
    assert (name, fixed) == ("uring", "0")
    assert "memlock limit 65536 bytes" in reason and "unregistered" in reason
