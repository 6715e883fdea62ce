"""The learned state of a store's model across restarts: the feature extractor and the predictor
as real processes checkpoint themselves into their folders and resume from them; a warm-up
checkpoint of another model's shape starts them cold, with a warning naming both shapes."""

import json
import signal
import time

import numpy as np
import pytest
import zmq

from common.bus import Publisher, ServiceUnavailable, stats
from common.config import load_config
from common.protocol import AccessEvent
from flashmoe.runtime.launch import Launcher
from flashmoe.sim.learning import Learning
from tests.support.services import wait_for

LAYERS, EXPERTS, TOP_K = 2, 8, 2  # the tiny store's


def settled(endpoint, least_events):
    """The stats once ``least_events`` have come and no more come (every event sent is in)."""
    current = wait_for(endpoint, lambda s: s["events"] >= least_events, what="the events")
    while True:
        time.sleep(0.3)
        latest = stats(endpoint)
        if latest["events"] == current["events"]:
            return latest
        current = latest


class Events:
    """A worker's AccessEvents of random routing, one sequence, on ``endpoint``."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.publisher = Publisher(self.ctx, load_config(env={}), endpoint)
        self.rng = np.random.default_rng(0)
        self.seq = 0

    def send(self, n: int) -> None:
        for _ in range(n):
            experts = [self.rng.choice(EXPERTS, TOP_K, replace=False).tolist()
                       for _ in range(LAYERS)]
            token = f"t{self.seq % 7}"
            self.publisher.publish(AccessEvent("w", 1, self.seq, 0, self.seq, token,
                                               f"t{(self.seq + 1) % 7}", experts, []))
            self.seq += 1

    def send_until(self, endpoint: str, counter: str) -> None:
        """One event at a time until the service at ``endpoint`` counts one ``counter`` (a
        SUB joins late; a message sent before it has joined is lost)."""
        for _ in range(200):
            self.send(1)
            try:
                if stats(endpoint)[counter]:
                    return
            except ServiceUnavailable:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{endpoint} never counted {counter}")

    def close(self) -> None:
        self.publisher.close()
        self.ctx.term()


@pytest.mark.slow
def test_learned_state_resumes_and_a_warmup_of_another_shape_starts_cold(tiny_store, tmp_path):
    other = tmp_path / "warmup-of-another-model"
    Learning.create(3, 4, TOP_K, load_config(env={})).save(other)
    fx_dir, predictor_dir = tmp_path / "fx", tmp_path / "predictor"
    events_endpoint = f"ipc://{tmp_path}/worker.events.sock"
    events = Events(events_endpoint)

    def start(launcher, only_extractor=False):
        if not only_extractor:
            launcher.start("predictor", [
                "serve-predictor", str(tiny_store), "--features",
                launcher.endpoint("feature_extractor"), "--checkpoint-dir", str(predictor_dir),
                "--warmup", str(other)])
        return launcher.start("feature_extractor", [
            "serve-features", str(tiny_store), "--events", events_endpoint, "--checkpoint-dir",
            str(fx_dir), "--warmup", str(other)])

    def launcher_of(name, every_s):
        return Launcher(load_config(env={}, overrides=[
            f"store.path={tiny_store}", f"predictor.checkpoint_every_s={every_s}"]),
            tmp_path / name)

    first = launcher_of("first", 3600)  # no periodic checkpoint: the shutdown's alone
    try:
        fx = start(first)
        events.send_until(first.children["predictor"].control_endpoint, "batches")
        events.send(40)
        before = settled(fx.control_endpoint, 41)
        predictor = stats(first.children["predictor"].control_endpoint)
        assert before["resumed_from"] == "" and predictor["resumed_from"] == ""
        assert before["checkpoints"] == 0 and not fx_dir.exists()
    finally:
        codes = first.stop_all()
    assert codes == {"feature_extractor": 0, "predictor": 0}  # a clean shutdown
    fx_log = (tmp_path / "first" / "feature_extractor.log").read_text()
    predictor_log = (tmp_path / "first" / "predictor.log").read_text()
    assert f"not resuming from {other}" in fx_log and "3 layers x 4 experts" in fx_log
    assert "does not fit 2 x 8" in fx_log and "starting cold" in fx_log
    assert f"not resuming from {other}" in predictor_log
    assert "(3, 4, " in predictor_log and "this predictor is (2, 8, " in predictor_log
    assert sorted(p.name for p in fx_dir.iterdir()) == ["extractor.json",
                                                        "extractor.safetensors"]

    second = launcher_of("second", 0.2)
    try:
        fx = start(second)
        resumed = stats(fx.control_endpoint)
        assert resumed["resumed_from"] == str(fx_dir)
        assert resumed["tokens_seen"] == before["tokens_seen"] > 0
        events.send_until(second.children["predictor"].control_endpoint, "batches")
        predictor = stats(second.children["predictor"].control_endpoint)
        assert predictor["resumed_from"] == str(predictor_dir)
        events.send(20)
        periodic = settled(fx.control_endpoint, 21)
        saved = fx_dir / "extractor.json"
        deadline = time.monotonic() + 30
        while json.loads(saved.read_text())["tokens"] != periodic["tokens_seen"]:
            assert time.monotonic() < deadline, "no periodic checkpoint of the last events"
            time.sleep(0.1)
        fx.proc.send_signal(signal.SIGKILL)  # no shutdown checkpoint: the periodic one stays
        fx.proc.wait(10)
        del second.children["feature_extractor"]
        again = start(second, only_extractor=True)
        tokens = stats(again.control_endpoint)["tokens_seen"]
        assert stats(again.control_endpoint)["resumed_from"] == str(fx_dir)
        assert tokens == periodic["tokens_seen"] > before["tokens_seen"]
    finally:
        second.stop_all()
        events.close()
