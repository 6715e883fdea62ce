"""IO engine faults, injected through the engines' test hook, on both engines (the io_uring
variant skips with the reason where the helper or io_uring is missing):

- delay: a completion held back past the read timeout -> IOTimeoutError naming
  io.read_timeout_s, the reads drained first, the engine failed for every later call;
- short_read: the kernel really returns fewer bytes for exactly the reads that were cut;
- submit_error: a submit fails after some of its reads went out -> the error is raised only
  after every read in flight was drained, unfinished reads hold -ECANCELED;
- eio: every N-th expert read (a run of ops into one slot) completes with -EIO, the others
  untouched, whether reaped or read;
- stale: forged completions with bad tags, and reads that land after a timed-out drain, are
  counted and written nowhere;
- close with reads in flight drains them.

Nothing here asserts how fast anything is; waits are generous and only bound a hang.
"""

import errno
import time

import numpy as np
import pytest

from common.arena import Arena
from common.store import ExpertStore
from services.cache_manager.io_engine import (SHORT_READ_BYTES, IOEngineError, IOTimeoutError,
                                              open_engine)
from tests.support.uring import uring_available

URING_OK, URING_WHY = uring_available()
KINDS = ["pread", pytest.param("uring", marks=pytest.mark.uring)]
N_SLOTS = 8


@pytest.fixture
def setup(tiny_store):
    """setup(kind, depth) -> (store, arena, engine); everything closed at teardown."""
    store = ExpertStore.open(tiny_store)
    arena = Arena.create(N_SLOTS, store.manifest.slot_bytes)
    opened = []

    def open_(kind: str, depth: int):
        if kind == "uring" and not URING_OK:
            pytest.skip(f"io_uring helper unavailable: {URING_WHY}")
        engine, _ = open_engine(kind, arena.mmap, arena.slot_bytes, N_SLOTS, store.stripe_paths,
                                depth)
        opened.append(engine)
        return store, arena, engine

    yield open_
    for engine in opened:
        engine.close()
    arena.close()


def experts_ops(store: ExpertStore, n: int) -> np.ndarray:
    return np.concatenate([store.read_ops(*key, slot)
                           for slot, key in enumerate(store.keys()[:n])])


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.01)


def assert_failed_for_good(engine, store) -> None:
    assert engine.failed
    for call in (lambda: engine.submit(store.read_ops(*store.keys()[0], slot=0)), engine.reap,
                 lambda: engine.read(store.read_ops(*store.keys()[0], slot=0)),
                 lambda: engine.check_timeout(60.0)):
        with pytest.raises(IOEngineError, match="failed earlier"):
            call()


@pytest.mark.parametrize("kind", KINDS)
def test_delayed_completion_times_out_and_fails_the_engine(setup, kind):
    store, _, engine = setup(kind, 4)
    engine.inject_fault("delay", 1000)
    ops = experts_ops(store, 2)
    batch_id = engine.submit(ops)
    engine.check_timeout(60.0)  # young reads are fine
    wait_until(lambda: (engine.oldest_inflight_s() or 0) > 0.1)
    with pytest.raises(IOTimeoutError, match=r"io\.read_timeout_s = 0\.1") as info:
        engine.check_timeout(0.1)
    assert engine.inflight() == engine.queued() == 0
    assert "drained" in str(info.value)
    [(abandoned_id, abandoned)] = info.value.batches
    assert abandoned_id == batch_id and abandoned is ops
    assert not (ops["result"] == -errno.EINPROGRESS).any()
    assert set(ops["result"]) <= {*ops["length"].tolist(), -errno.ECANCELED}
    assert engine.stats["faults_injected"] > 0
    assert_failed_for_good(engine, store)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failing_engine_tells_its_owner_before_it_drains(setup, kind):
    """The cache manager answers the waiting requests from ``on_failing``: it runs while the
    reads are still in flight, so nobody waits out the drain."""
    store, _, engine = setup(kind, 4)
    engine.inject_fault("delay", 1000)
    seen = []
    engine.on_failing = lambda reason: seen.append((reason, engine.inflight(), engine.failed))
    engine.submit(experts_ops(store, 2))
    wait_until(lambda: (engine.oldest_inflight_s() or 0) > 0.1)
    with pytest.raises(IOTimeoutError):
        engine.check_timeout(0.1)
    [(reason, inflight, failed)] = seen
    assert "io.read_timeout_s" in reason and inflight > 0 and not failed


@pytest.mark.parametrize("kind", KINDS)
def test_read_times_out_on_a_delayed_completion(setup, kind):
    store, _, engine = setup(kind, 4)
    engine.inject_fault("delay", 1000)
    with pytest.raises(IOTimeoutError, match="timeout_s = 0.05"):
        engine.read(experts_ops(store, 1), timeout_s=0.05)
    assert engine.inflight() == 0
    assert_failed_for_good(engine, store)


@pytest.mark.parametrize("kind", KINDS)
def test_short_read_shortens_exactly_the_reads_it_cut(setup, kind):
    store, arena, engine = setup(kind, 1)  # depth 1: reads go out in op order
    engine.inject_fault("short_read", 2)
    ops = experts_ops(store, 4)
    engine.read(ops)
    cut = (np.arange(len(ops)) % 2 == 1) & (ops["length"] > SHORT_READ_BYTES)
    assert cut.any() and (~cut).any()
    assert (ops["result"][cut] == ops["length"][cut] - SHORT_READ_BYTES).all()
    assert (ops["result"][~cut] == ops["length"][~cut]).all()
    assert engine.stats["faults_injected"] == int(cut.sum())
    engine.inject_fault("short_read", 0)
    again = experts_ops(store, 4)
    engine.read(again)
    assert (again["result"] == again["length"]).all()
    for slot, key in enumerate(store.keys()[:4]):
        store.verify_expert_bytes(*key, arena.slot(slot))


@pytest.mark.parametrize("kind", KINDS)
def test_eio_fails_every_nth_expert_read(setup, kind):
    store, arena, engine = setup(kind, 4)
    engine.inject_fault("eio", 3)
    ops = experts_ops(store, 6)
    engine.read(ops)
    failed = [slot for slot in range(6) if (ops["result"][ops["buf_index"] == slot] < 0).any()]
    assert failed == [2, 5]
    for slot in failed:
        mine = ops[ops["buf_index"] == slot]
        assert mine["result"][0] == -errno.EIO and (mine["result"][1:] == mine["length"][1:]).all()
    ok = ~np.isin(ops["buf_index"], failed)
    assert (ops["result"][ok] == ops["length"][ok]).all()
    assert engine.stats["faults_injected"] == 2 and engine.stats["faults"] == {"eio": 3}
    engine.inject_fault("eio", 0)
    again = experts_ops(store, 6)
    batch = engine.submit(again)
    wait_until(lambda: any(done == batch for done, _ in engine.reap()))
    assert (again["result"] == again["length"]).all() and not engine.failed


@pytest.mark.parametrize("kind", KINDS)
def test_submit_error_mid_batch_drains_before_raising(setup, kind):
    store, _, engine = setup(kind, 8)
    engine.inject_fault("submit_error", 2)
    ops = experts_ops(store, 3)
    with pytest.raises(IOEngineError, match="submit") as info:
        engine.submit(ops)
    assert not isinstance(info.value, IOTimeoutError)
    assert engine.inflight() == engine.queued() == 0
    assert "drained" in str(info.value)
    [(_, abandoned)] = info.value.batches
    assert abandoned is ops
    assert (ops["result"][:2] == ops["length"][:2]).all()  # went out: completed for real
    assert (ops["result"][2:] == -errno.ECANCELED).all()  # never went out
    assert_failed_for_good(engine, store)


@pytest.mark.parametrize("kind", KINDS)
def test_submit_error_fails_the_batches_in_flight_too(setup, kind):
    store, _, engine = setup(kind, 2)
    engine.inject_fault("delay", 200)  # keeps the first batch in flight
    first = experts_ops(store, 4)
    first_id = engine.submit(first)
    engine.inject_fault("submit_error", 1)
    second = store.read_ops(*store.keys()[5], slot=5)
    with pytest.raises(IOEngineError) as info:
        engine.submit(second)
    assert engine.inflight() == engine.queued() == 0
    abandoned = dict(info.value.batches)
    assert abandoned[first_id] is first and len(abandoned) == 2
    for ops in (first, second):
        assert set(ops["result"]) <= {*ops["length"].tolist(), -errno.ECANCELED}
    assert (second["result"] == -errno.ECANCELED).any()


@pytest.mark.parametrize("kind", KINDS)
def test_stale_completions_are_counted_and_written_nowhere(setup, kind):
    store, arena, engine = setup(kind, 4)
    ops = experts_ops(store, 3)
    batch_id = engine.submit(ops)  # active until reaped, whatever the disk does meanwhile
    engine.inject_fault("stale", 8)
    assert engine.stats["stale"] == 8
    done = {}
    wait_until(lambda: done.update(engine.reap()) or batch_id in done)
    assert (ops["result"] == ops["length"]).all()
    for slot, key in enumerate(store.keys()[:3]):
        store.verify_expert_bytes(*key, arena.slot(slot))
    assert engine.stats["stale"] == 8


@pytest.mark.parametrize("kind", KINDS)
def test_reads_landing_after_the_drain_timeout_are_stale(setup, kind):
    store, _, engine = setup(kind, 16)
    engine.inject_fault("delay", 300)  # pread: keeps its threads inside the reads
    engine.inject_fault("submit_error", 8)
    engine.drain_timeout_s = 1e-9
    ops = experts_ops(store, 8)
    with pytest.raises(IOEngineError, match="may still land") as info:
        engine.submit(ops)
    late = engine.inflight()
    if late == 0:  # the kernel answered every read within the bound (uring)
        pytest.skip("every read completed within a 1 ns drain: none left to land late")
    [(_, abandoned)] = info.value.batches
    assert abandoned is ops and (ops["result"][8:] == -errno.ECANCELED).all()
    at_failure = ops.copy()
    engine.drain_timeout_s = 30.0
    engine.close()  # drains the late ones: counted, written nowhere
    assert engine.stats["stale"] == late
    assert (ops == at_failure).all()


@pytest.mark.parametrize("kind", KINDS)
def test_close_with_reads_in_flight_drains_them(setup, kind):
    store, _, engine = setup(kind, 2)
    batches = [experts_ops(store, 4) for _ in range(3)]
    for ops in batches:
        engine.submit(ops)
    engine.close()
    for ops in batches:
        assert set(ops["result"]) <= {*ops["length"].tolist(), -errno.ECANCELED}
    assert engine.inflight() == engine.queued() == 0 and engine.stats["stale"] == 0
    with pytest.raises(IOEngineError, match="closed"):
        engine.submit(batches[0])
    engine.close()  # twice is fine
