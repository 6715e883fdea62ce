"""The feature extractor and the predictor as real processes, under what used to stop them:
a full disk at every checkpoint (``FLASHMOE_CHECKPOINT_FAULT=enospc``), a damaged checkpoint
of their own, and well-formed bus messages whose values do not fit the model. Each goes on
learning; the bad input is counted, logged at a bounded rate, and costs nothing else."""

import time

import numpy as np
import zmq

from common.bus import Publisher, stats
from common.config import load_config
from common.protocol import AccessEvent, FeatureBatch
from flashmoe.runtime.launch import Launcher
from services.feature_extractor.sharing import predictor_inputs
from tests.integration.test_learned_state import EXPERTS, LAYERS, Events, settled
from tests.support.services import wait_for


def start_both(launcher: Launcher, store, tmp_path, events_endpoint: str, env=None,
               features_extra: str = ""):
    predictor = launcher.start("predictor", [
        "serve-predictor", str(store), "--features",
        launcher.endpoint("feature_extractor") + features_extra, "--checkpoint-dir",
        str(tmp_path / "predictor")], env=env)
    extractor = launcher.start("feature_extractor", [
        "serve-features", str(store), "--events", events_endpoint, "--checkpoint-dir",
        str(tmp_path / "fx")], env=env)
    return extractor, predictor


def launcher_of(store, tmp_path, every_s: float) -> Launcher:
    return Launcher(load_config(env={}, overrides=[
        f"store.path={store}", f"predictor.checkpoint_every_s={every_s}"]), tmp_path / "run")


def test_a_full_disk_at_every_checkpoint_skips_it_and_learning_goes_on(tiny_store, tmp_path):
    env = {"FLASHMOE_CHECKPOINT_FAULT": "enospc"}
    load_config(env=env)  # the config leaves the variable to the services
    events_endpoint = f"ipc://{tmp_path}/worker.events.sock"
    events = Events(events_endpoint)
    launcher = launcher_of(tiny_store, tmp_path, 0.2)
    try:
        extractor, predictor = start_both(launcher, tiny_store, tmp_path, events_endpoint, env)
        events.send_until(predictor.control_endpoint, "batches")
        for _ in range(10):  # events over a few checkpoint periods
            events.send(5)
            time.sleep(0.2)
        for child in (extractor, predictor):
            current = wait_for(child.control_endpoint, lambda s: s["checkpoint_failures"] >= 3,
                               what="several failed checkpoints")
            assert current["checkpoints"] == 0 and current["state"] == "running"
        assert settled(extractor.control_endpoint, 51)["batches"] >= 50
    finally:
        codes = launcher.stop_all()
        events.close()
    assert codes == {"feature_extractor": 0, "predictor": 0}  # the shutdown's failure too
    for folder in ("fx", "predictor"):  # nothing written, no temporary file left
        assert not list((tmp_path / folder).glob("*")), folder
    for name in ("feature_extractor", "predictor"):
        log = (tmp_path / "run" / f"{name}.log").read_text()
        assert log.count("FAULT INJECTION") == 1, name
        warnings = log.count("checkpoint skipped")
        assert warnings >= 1 and "No space left on device" in log, name
        assert warnings < 10, f"{name}: a warning at every failure: {warnings}"


def test_a_damaged_checkpoint_of_its_own_is_moved_aside_and_learning_starts_cold(tiny_store,
                                                                                 tmp_path):
    events_endpoint = f"ipc://{tmp_path}/worker.events.sock"
    events = Events(events_endpoint)
    launcher = launcher_of(tiny_store, tmp_path, 3600)
    try:  # a first run leaves whole checkpoints at its shutdown
        extractor, predictor = start_both(launcher, tiny_store, tmp_path, events_endpoint)
        events.send_until(predictor.control_endpoint, "batches")
        events.send(20)
        settled(extractor.control_endpoint, 21)
    finally:
        assert launcher.stop_all() == {"feature_extractor": 0, "predictor": 0}
    (tmp_path / "predictor" / "predictor.safetensors").write_bytes(b"")  # zero-length
    fx_file = tmp_path / "fx" / "extractor.safetensors"
    fx_file.write_bytes(fx_file.read_bytes()[:100])  # truncated
    launcher = launcher_of(tiny_store, tmp_path / "second", 3600)
    try:
        extractor, predictor = start_both(launcher, tiny_store, tmp_path, events_endpoint)
        assert stats(extractor.control_endpoint)["resumed_from"] == ""
        events.send_until(predictor.control_endpoint, "batches")
        events.send(10)
        learned = wait_for(predictor.control_endpoint, lambda s: s["batches"] >= 10,
                           what="batches after a cold start")
        assert learned["resumed_from"] == "" and learned["state"] == "running"
    finally:
        codes = launcher.stop_all()
        events.close()
    assert codes == {"feature_extractor": 0, "predictor": 0}
    assert (tmp_path / "predictor" / "predictor.safetensors.damaged").read_bytes() == b""
    assert (tmp_path / "fx" / "extractor.safetensors.damaged").stat().st_size == 100
    assert (tmp_path / "predictor" / "predictor.safetensors").stat().st_size > 0  # saved anew
    log = (tmp_path / "second" / "run" / "predictor.log").read_text()
    assert log.count("damaged checkpoint") == 1


def test_messages_that_do_not_fit_the_model_are_dropped_and_counted(tiny_store, tmp_path):
    events_endpoint = f"ipc://{tmp_path}/worker.events.sock"
    rogue_endpoint = f"ipc://{tmp_path}/rogue.sock"
    events = Events(events_endpoint)
    ctx = zmq.Context()
    rogue = Publisher(ctx, load_config(env={}), rogue_endpoint)
    launcher = launcher_of(tiny_store, tmp_path, 3600)
    good = [[e, (e + 1) % EXPERTS] for e in range(LAYERS)]
    hostile_events = {
        "expert_range": AccessEvent("w", 1, 0, 0, 0, "a", "b", [[0, EXPERTS]] + good[1:], []),
        "probs_shape": AccessEvent("w", 1, 1, 0, 1, "a", "b", good, [[0.5, 0.3, 0.2]] * LAYERS),
        "probs_value": AccessEvent("w", 1, 2, 0, 2, "a", "b", good,
                                   [[float("nan"), 0.5]] * LAYERS),
        "layers": AccessEvent("w", 1, 3, 0, 3, "a", "b", good * 3, []),  # another model's
        "top_k": AccessEvent("w", 1, 4, 0, 4, "a", "b", [[0, 1, 2]] * LAYERS, []),
    }
    try:
        extractor, predictor = start_both(launcher, tiny_store, tmp_path, events_endpoint,
                                          features_extra="," + rogue_endpoint)
        events.send_until(predictor.control_endpoint, "batches")
        assert not [k for k in stats(predictor.control_endpoint) if k.startswith("dropped_")]
        for event in hostile_events.values():
            events.publisher.publish(event)
        events.send(5)
        current = settled(extractor.control_endpoint, 5 + len(hostile_events) + 1)
        for reason in hostile_events:
            assert current[f"dropped_{reason}"] == 1, (reason, current)
        assert current["state"] == "running" and extractor.proc.poll() is None

        dims, features = predictor_inputs(EXPERTS, 128)  # the session's (the extractor's)

        def rogue_batch(seq, experts, dims):
            return FeatureBatch("rogue", 1, seq, 0, "w", 1, experts, LAYERS, EXPERTS,
                                np.zeros((LAYERS, dims), np.float32).tobytes(), dims,
                                np.zeros((LAYERS * EXPERTS, features), np.float16).tobytes(),
                                features, 0.5)

        batch = rogue_batch(0, good, dims + 3)
        wrong_ids = rogue_batch(1, [[0, 99]] * LAYERS, dims)
        for _ in range(100):  # until the predictor's SUB has joined the rogue endpoint
            rogue.publish(batch)
            time.sleep(0.1)
            if stats(predictor.control_endpoint).get("dropped_dims"):
                break
        rogue.publish(wrong_ids)
        wait_for(predictor.control_endpoint, lambda s: s.get("dropped_expert_range", 0) == 1,
                 what="the rogue batch with expert ids past the model's")
        before = stats(predictor.control_endpoint)["batches"]
        events.send(5)
        after = wait_for(predictor.control_endpoint, lambda s: s["batches"] >= before + 5,
                         what="good batches after the rogue ones")
        assert after["state"] == "running" and predictor.proc.poll() is None
    finally:
        codes = launcher.stop_all()
        events.close()
        rogue.close()
        ctx.term()
    assert codes == {"feature_extractor": 0, "predictor": 0}
