"""Durable learned state: a checkpoint write goes through a synced temporary file (removed when
the write fails), a full disk (``FLASHMOE_CHECKPOINT_FAULT=enospc``) leaves the previous
checkpoint whole, and a damaged checkpoint (zero-length, truncated, garbage, wrong tensors) in
a service's own folder is moved aside and learning starts cold, while a damaged ``--warmup``
the user owns is only skipped."""

import errno
import logging
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from common import checkpoints
from common.checkpoints import (
    CheckpointDamaged,
    CheckpointMismatch,
    Throttle,
    arm_checkpoint_fault,
    resume,
    write_durably,
)
from services.feature_extractor.core import (
    CHECKPOINT_FILES as EXTRACTOR_FILES,
    ExtractorCore,
    load_checkpoint,
    save_checkpoint,
)
from services.predictor.core import CHECKPOINT_FILES as PREDICTOR_FILES
from services.predictor.core import Learner

L, E, K, PCA = 2, 8, 2, 4
log = logging.getLogger("test")


@pytest.fixture
def fault_off():
    yield
    arm_checkpoint_fault(log, env={})


def trained_learner(tokens: int = 24) -> Learner:
    learner = Learner(L, E, 4, 15)
    rng = np.random.default_rng(0)
    for _ in range(tokens):
        learner.predict(rng.random((L * E, 15), np.float32), rng.random((L, 4), np.float32))
        learner.observe(rng.choice(L * E, L * K, replace=False))
    return learner


def fed_extractor() -> ExtractorCore:
    core = ExtractorCore(L, E, K, PCA)
    for t in range(30):
        core.on_event(0, t, f"w{t % 4}", f"w{(t + 1) % 4}",
                      [[t % E, (t + 1) % E], [(t + 2) % E, (t + 5) % E]], [])
    return core


def test_a_write_syncs_file_and_folder_and_a_failed_one_leaves_no_temporary(tmp_path,
                                                                             monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(
        f"/proc/self/fd/{fd}")), real_fsync(fd)))
    target = tmp_path / "state.bin"
    write_durably(target, lambda tmp: tmp.write_bytes(b"one"))
    assert target.read_bytes() == b"one"
    assert str(target) + ".tmp" in synced and str(tmp_path) in synced

    def half_then_fail(tmp):
        tmp.write_bytes(b"half")
        raise OSError(errno.EIO, "the disk said no")

    with pytest.raises(OSError):
        write_durably(target, half_then_fail)
    assert target.read_bytes() == b"one" and sorted(tmp_path.iterdir()) == [target]


def test_the_enospc_fault_fails_every_checkpoint_and_keeps_the_previous(tmp_path, caplog,
                                                                         fault_off):
    learner, core = trained_learner(), fed_extractor()
    learner.save(tmp_path)
    save_checkpoint(core, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with caplog.at_level(logging.WARNING):
        assert arm_checkpoint_fault(log, env={checkpoints.FAULT_ENV: "enospc"}) == "enospc"
    assert "FAULT INJECTION" in caplog.text
    trained_more = trained_learner(40)
    for save in (lambda: trained_more.save(tmp_path), lambda: save_checkpoint(core, tmp_path)):
        with pytest.raises(OSError) as caught:
            save()
        assert caught.value.errno == errno.ENOSPC
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no *.tmp either
    with pytest.raises(ValueError):
        arm_checkpoint_fault(log, env={checkpoints.FAULT_ENV: "nope"})


def damage(kind: str, path):
    data = path.read_bytes()
    if kind == "zero-length":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif kind == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif kind == "header-garbage":
        path.write_bytes(b"\xff" * 8 + data[8:])


def wrong_tensor(path):
    tensors = load_file(str(path))
    name = next(iter(tensors))
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(path))


def nan_tensor(path):
    tensors = load_file(str(path))
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(path))


KINDS = ["zero-length", "truncated", "garbage", "header-garbage", "wrong-tensor", "nan-tensor"]


def apply(kind: str, folder, stem: str):
    if kind == "wrong-tensor":
        wrong_tensor(folder / f"{stem}.safetensors")
    elif kind == "nan-tensor":
        nan_tensor(folder / f"{stem}.safetensors")
    else:
        damage(kind, folder / f"{stem}.safetensors")


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_predictor_checkpoint_is_moved_aside_and_learning_starts_cold(tmp_path,
                                                                                caplog, kind):
    own, warmup = tmp_path / "own", tmp_path / "warmup"
    trained_learner().save(own)
    trained_learner().save(warmup)
    apply(kind, own, "predictor")
    fresh = Learner(L, E, 4, 15)
    weights = {k: v.clone() for k, v in fresh.net.state_dict().items()}
    with caplog.at_level(logging.WARNING):
        source, meta = resume((own,), "predictor.json", fresh.load, log, PREDICTOR_FILES)
    assert (source, meta) == ("", None)
    assert all(torch.equal(v, weights[k]) for k, v in fresh.net.state_dict().items())
    assert "damaged checkpoint" in caplog.text and caplog.text.count("damaged checkpoint") == 1
    assert not (own / "predictor.json").exists()
    assert (own / "predictor.json.damaged").exists()
    # a damaged warm-up the user owns is skipped, not moved
    apply(kind, warmup, "predictor")
    names = sorted(p.name for p in warmup.iterdir())
    assert resume(("", warmup), "predictor.json", Learner(L, E, 4, 15).load, log,
                  PREDICTOR_FILES) == ("", None)
    assert sorted(p.name for p in warmup.iterdir()) == names


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_extractor_checkpoint_is_moved_aside_and_learning_starts_cold(tmp_path,
                                                                                kind):
    save_checkpoint(fed_extractor(), tmp_path)
    if kind in ("wrong-tensor", "nan-tensor"):
        from safetensors.numpy import load_file as np_load, save_file as np_save
        path = tmp_path / "extractor.safetensors"
        from safetensors import safe_open
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata()
        arrays = np_load(str(path))
        arrays["fx.ema2"] = np.zeros(3, np.float32) if kind == "wrong-tensor" else \
            np.full_like(arrays["fx.ema2"], np.nan)
        np_save(arrays, str(path), metadata=metadata)
    else:
        damage(kind, tmp_path / "extractor.safetensors")
    fresh = ExtractorCore(L, E, K, PCA)
    with pytest.raises(CheckpointDamaged):
        load_checkpoint(fresh, tmp_path)
    assert fresh.features.t == 0 and not fresh.features.token_row
    loaded = []

    def load(folder):
        core = ExtractorCore(L, E, K, PCA)
        meta = load_checkpoint(core, folder)
        loaded.append(core)
        return meta

    assert resume((tmp_path,), "extractor.json", load, log, EXTRACTOR_FILES) == ("", None)
    assert not loaded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extractor.json.damaged",
                                                          "extractor.safetensors.damaged"]


def test_another_models_checkpoint_is_a_mismatch_kept_in_place(tmp_path):
    trained_learner().save(tmp_path)
    save_checkpoint(fed_extractor(), tmp_path)
    with pytest.raises(CheckpointMismatch):
        Learner(L + 1, E, 4, 15).load(tmp_path)
    with pytest.raises(CheckpointMismatch):
        load_checkpoint(ExtractorCore(L, E * 2, K, PCA), tmp_path)
    assert resume((tmp_path,), "predictor.json", Learner(L + 1, E, 4, 15).load, log,
                  PREDICTOR_FILES) == ("", None)
    assert (tmp_path / "predictor.safetensors").exists()


def test_a_whole_checkpoint_resumes_even_if_its_json_was_torn(tmp_path):
    """The safetensors file carries the meta too: a torn ``predictor.json`` costs nothing."""
    learner = trained_learner()
    learner.save(tmp_path, {"note": 1})
    (tmp_path / "predictor.json").write_bytes(b"")
    fresh = Learner(L, E, 4, 15)
    source, meta = resume((tmp_path,), "predictor.json", fresh.load, log, PREDICTOR_FILES)
    assert source == str(tmp_path) and meta["note"] == 1 and fresh.steps == learner.steps
    assert meta["tokens"] == learner.t


def test_throttle_logs_once_per_interval_and_counts_what_it_held(caplog):
    now = [0.0]
    throttle = Throttle(log, every_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING):
        assert throttle.warning("disk full")
        assert not throttle.warning("disk full") and not throttle.warning("disk full")
        now[0] = 61
        assert throttle.warning("disk full")
    assert caplog.text.count("disk full") == 2 and "2 more like it" in caplog.text


def test_a_damaged_checkpoint_that_cannot_be_moved_aside_still_means_a_cold_start(tmp_path,
                                                                                   caplog):
    trained_learner().save(tmp_path)
    (tmp_path / "predictor.safetensors").write_bytes(b"")
    blocker = tmp_path / "predictor.safetensors.damaged"  # a folder in the way of the rename
    blocker.mkdir()
    (blocker / "keep").write_text("x")
    with caplog.at_level(logging.WARNING):
        assert resume((tmp_path,), "predictor.json", Learner(L, E, 4, 15).load, log,
                      PREDICTOR_FILES) == ("", None)
    assert "not moved aside" in caplog.text
