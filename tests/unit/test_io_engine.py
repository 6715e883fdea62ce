"""IO engines read exactly the store's bytes; auto falls back to pread with a reason."""

import errno

import numpy as np
import pytest

from common.arena import Arena
from common.store import ExpertStore
from services.cache_manager import io_engine
from services.cache_manager.io_engine import IOEngineError, open_engine
from tests.conftest import uring_available

URING_OK, URING_WHY = uring_available()


def engines():
    yield "pread"
    if URING_OK:
        yield "uring"


@pytest.fixture
def store_and_arena(tiny_store):
    store = ExpertStore.open(tiny_store)
    arena = Arena.create(4, store.manifest.slot_bytes)
    yield store, arena
    arena.close()


@pytest.mark.parametrize("kind", list(engines()))
@pytest.mark.parametrize("depth", [1, 4, 32])
def test_batched_reads_match_checksums(store_and_arena, kind, depth):
    store, arena = store_and_arena
    engine, reason = open_engine(kind, arena.mmap, arena.slot_bytes, 4, store.stripe_paths, depth)
    try:
        assert engine.name == kind and reason == ""
        keys = store.keys()[:4]
        ops = np.concatenate([store.read_ops(l, e, slot) for slot, (l, e) in enumerate(keys)])
        engine.read(ops)
        assert (ops["result"] == ops["length"]).all()
        assert (ops["t_complete_ns"] >= ops["t_submit_ns"]).all()
        for slot, (l, e) in enumerate(keys):
            store.verify_expert_bytes(l, e, arena.slot(slot))
    finally:
        engine.close()


@pytest.mark.parametrize("kind", list(engines()))
def test_out_of_range_ops_fail_alone(store_and_arena, kind):
    store, arena = store_and_arena
    engine, _ = open_engine(kind, arena.mmap, arena.slot_bytes, 4, store.stripe_paths, 2)
    try:
        ops = np.concatenate([store.read_ops(*store.keys()[0], slot=0),
                              store.read_ops(*store.keys()[1], slot=1)])
        ops[0]["buf_index"] = 99
        ops[1]["file_index"] = 7
        engine.read(ops)
        assert ops[0]["result"] == ops[1]["result"] == -errno.EINVAL
        assert (ops[2:]["result"] == ops[2:]["length"]).all()
    finally:
        engine.close()


@pytest.mark.uring
def test_uring_helper_loads_here():
    if not URING_OK:
        pytest.skip(f"io_uring helper unavailable: {URING_WHY}")
    assert io_engine.HELPER_LIBRARY.exists()


def test_auto_falls_back_to_pread_with_reason(store_and_arena, monkeypatch, tmp_path):
    store, arena = store_and_arena
    monkeypatch.setattr(io_engine, "HELPER_LIBRARY", tmp_path / "missing.so")
    engine, reason = open_engine("auto", arena.mmap, arena.slot_bytes, 4, store.stripe_paths, 4)
    try:
        assert engine.name == "pread" and "not built" in reason
    finally:
        engine.close()
    with pytest.raises(IOEngineError, match="not built"):
        open_engine("uring", arena.mmap, arena.slot_bytes, 4, store.stripe_paths, 4)
    with pytest.raises(IOEngineError, match="unknown IO engine"):
        open_engine("spdk", arena.mmap, arena.slot_bytes, 4, store.stripe_paths, 4)
