"""The learning trio live: a trace-driven worker publishing AccessEvents, the feature
extractor, the predictor and the cache manager as real processes over real ZeroMQ."""

import json
import os
import signal
import subprocess
import time

import pytest
import zmq

from common.bus import Publisher, stats
from common.config import load_config
from common.protocol import SCHEMA_VERSION, AccessEvent, encode
from common.traces import load_gptoss20b, save_trace
from flashmoe.sim.device_model import DEVICES
from flashmoe.runtime.launch import Launcher, child_env, cli_command
from flashmoe.sim.learning import LearningPath, Learning
from flashmoe.sim.replay import replay_core
from flashmoe.tools.synth_store import synth_store
from tests.support.services import wait_for
from tests.support.traces import sequences_slice

pytestmark = pytest.mark.traces
TOKEN_MS = 120.0  # the worker's pace: a decode step of a real model on an edge box


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    store = synth_store(root / "store", "gpt-oss-tiny", scale=1.0, block_size=8192,
                        parallelism=3, show_progress=False).path
    train = sequences_slice(load_gptoss20b("train"), "train-slice", 0, 3)
    evaluation = sequences_slice(load_gptoss20b("eval"), "eval-slice", 0, 1)
    evaluation_file = root / "eval.npz"
    save_trace(evaluation, evaluation_file)
    ckpt = root / "warmup"
    from flashmoe.sim.learning import warmup

    warmup(train, load_config(env={}), ckpt)
    return {"store": store, "trace": evaluation, "trace_file": evaluation_file, "ckpt": ckpt,
            "root": root}


def start_trio(setup, tmp_path, *overrides):
    config = load_config(env={}, overrides=[f"store.path={setup['store']}",
                                            "cache.policy=flashmoe", *overrides])
    launcher = Launcher(config, tmp_path)
    events = launcher.endpoint("worker.events")
    launcher.start("predictor", ["serve-predictor", str(setup["store"]), "--features",
                                 launcher.endpoint("feature_extractor"), "--checkpoint-dir",
                                 str(tmp_path / "predictor-ckpt"), "--warmup",
                                 str(setup["ckpt"])])
    launcher.start("feature_extractor", ["serve-features", str(setup["store"]), "--events",
                                         events, "--warmup", str(setup["ckpt"])])
    launcher.start("cache_manager", ["serve-cache", str(setup["store"]), "--predictions",
                                     launcher.endpoint("predictor")])
    return launcher, events


def run_worker(launcher, setup, events, tokens=None, token_ms=TOKEN_MS, wait=True):
    out = launcher.runtime_dir / "worker.json"
    cmd = cli_command("trace-worker", "--cache", launcher.endpoint("cache_manager"), "--trace",
                      str(setup["trace_file"]), "--events", events, "--token-ms", str(token_ms),
                      "--json", str(out), "--config", str(launcher.config_path))
    if tokens:
        cmd += ["--tokens", str(tokens)]
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc, out
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return json.loads(out.read_text())


def test_no_event_lost_and_the_live_hit_rate_is_the_simulators(setup, tmp_path):
    capacity = 96
    launcher, events = start_trio(setup, tmp_path, f"cache.capacity_experts={capacity}",
                                  "prefetch.inline=false", "prefetch.learned=0")
    try:
        live = run_worker(launcher, setup, events)
        trace = setup["trace"]
        T = trace.n_tokens
        fx = wait_for(launcher.children["feature_extractor"].control_endpoint,
                      lambda s: s["events"] >= T, what="every event at the extractor")
        predictor = wait_for(launcher.children["predictor"].control_endpoint,
                             lambda s: s["batches"] >= T - 1, what="every batch")
    finally:
        launcher.stop_all()
    assert fx["events"] == T and fx["n_gap"] == 0 and fx["n_out_of_order"] == 0
    assert predictor["batches"] == T - 1 and predictor["n_gap"] == 0  # the last token: none
    assert 0.2 < predictor["recall_at_k"] <= 1.0  # a hot list of 4 of 32 gets ~0.26
    assert live["predictions"] > T / 4 and live["rejected_malformed"] == 0
    # The simulator on the same slice, the same checkpoint, the worker's pace as its clock.
    learning = Learning.create(trace.num_layers, trace.num_experts, trace.top_k,
                               load_config(env={}))
    learning.load(setup["ckpt"])
    hooks = LearningPath(trace, learning, load_config(env={}).predictor.publish_interval_ms)
    sim = replay_core("flashmoe", capacity, trace, "global", DEVICES["orin-980pro"], 1,
                      TOKEN_MS / trace.num_layers, hooks=hooks)
    accesses = T * trace.num_layers * trace.top_k
    live_rate = live["n_hit"] / (live["n_hit"] + live["n_miss"])
    sim_rate = sim.stats["n_hit"] / accesses
    assert live["n_hit"] + live["n_miss"] == accesses
    assert abs(live_rate - sim_rate) <= 0.005, (live_rate, sim_rate, live["predictions"],
                                                hooks.published)


def test_the_look_ahead_prefetch_loads_what_the_estimate_needs_while_the_disk_idles(
        setup, tmp_path):
    """With live estimates, FlashMoE's look-ahead prefetch (the inline one off) loads experts
    between the worker's requests, and the worker uses some of them. A ratio of 2: after a
    warm-up on three sequences the estimate is unsure, and at the default 6 these 80 tokens
    gave 6 look-ahead loads (the simulator on the same slice too); at 2, ~1,000, ~380 used."""
    launcher, events = start_trio(setup, tmp_path, "cache.capacity_experts=96",
                                  "prefetch.inline=false", "prefetch.learned=2",
                                  "prefetch.learned_ratio=2")
    try:
        live = run_worker(launcher, setup, events, tokens=80)
    finally:
        launcher.stop_all()
    trace = setup["trace"]
    assert live["n_hit"] + live["n_miss"] == 80 * trace.num_layers * trace.top_k
    assert live["prefetch_learned"] > 0 and live["prefetch_issued"] > 0
    assert live["prefetch_used"] > 0


def test_a_killed_predictor_means_lru_then_a_resumed_predictor(setup, tmp_path):
    launcher, events = start_trio(setup, tmp_path, "cache.capacity_experts=96",
                                  "predictor.checkpoint_every_s=0.5", "predictor.max_age_ms=400")
    try:
        worker, out = run_worker(launcher, setup, events, token_ms=40, wait=False)
        predictor = launcher.children["predictor"]
        cache = launcher.children["cache_manager"].control_endpoint
        wait_for(predictor.control_endpoint, lambda s: s["checkpoints"] >= 1,
                 what="a predictor checkpoint")
        wait_for(cache, lambda s: s["estimate"] == "fresh", what="predictions in use")
        os.kill(predictor.proc.pid, signal.SIGKILL)
        predictor.proc.wait(10)
        before = stats(cache)["n_acquire"]
        fallback = wait_for(cache, lambda s: s["estimate"] == "none", timeout_s=10,
                            what="the LRU fallback")
        assert fallback["estimate_expired"] >= 1
        wait_for(cache, lambda s: s["n_acquire"] > before + 100, what="requests still served")
        del launcher.children["predictor"]
        restarted = launcher.start("predictor", predictor.args[:predictor.args.index(
            "--endpoint")])
        resumed = wait_for(restarted.control_endpoint, lambda s: s["batches"] > 0,
                           what="the restarted predictor's first batch")
        assert resumed["resumed_from"] == str(tmp_path / "predictor-ckpt")
        from services.predictor import fast_infer  # the stats name the inference path
        assert resumed["inference"].startswith(
            "fused C, int8 heads" if fast_infer.load() is not None else "numpy")
        wait_for(cache, lambda s: s["estimate"] == "fresh", what="predictions again")
        _, err = worker.communicate(timeout=600)
        assert worker.returncode == 0, err
    finally:
        launcher.stop_all()


def test_malformed_and_wrong_version_messages_are_counted_and_dropped(setup, tmp_path):
    ctx = zmq.Context()
    config = load_config(env={})
    rogue_endpoint = f"ipc://{tmp_path}/rogue.sock"
    rogue = Publisher(ctx, config, rogue_endpoint)
    good = Publisher(ctx, config, f"ipc://{tmp_path}/good.sock")
    launcher = Launcher(load_config(env={}, overrides=[f"store.path={setup['store']}"]),
                        tmp_path / "run")
    try:
        child = launcher.start("feature_extractor", [
            "serve-features", str(setup["store"]), "--events",
            f"{rogue_endpoint},ipc://{tmp_path}/good.sock"])
        trace = setup["trace"]
        bad = [b"\xc1garbage", encode(AccessEvent("x", 1, 0, 0, 0, "a", "b", [[1]], [])),
               b"\x92" + bytes([SCHEMA_VERSION + 1]) + b"\x90"]
        for _ in range(50):  # until the subscription is live
            rogue.socket.send(bad[0])
            if stats(child.control_endpoint)["rejected_malformed"]:
                break
            time.sleep(0.1)
        for frame in bad[1:]:
            rogue.socket.send(frame)
        for t in range(5):
            good.publish(AccessEvent("w", 1, t, 0, t, "a", "b", trace.experts[t].tolist(), []))
        current = wait_for(child.control_endpoint, lambda s: s["events"] >= 6,
                           what="the good events")
        assert current["dropped_layers"] == 1 and current["rejected_wrong_version"] == 1
        assert current["rejected_malformed"] >= 1 and current["batches"] == 5
        assert child.proc.poll() is None
    finally:
        launcher.stop_all()
        rogue.close()
        good.close()
        ctx.term()


def test_a_warm_up_of_another_shape_means_a_cold_start_not_a_crash(tmp_path):
    """The extractor and the predictor given a warm-up checkpoint of another model's shape
    say so and start cold."""
    from services.feature_extractor.core import ExtractorCore, save_checkpoint
    from services.feature_extractor.process import FeatureExtractorService
    from services.predictor.core import Learner
    from services.predictor.process import PredictorService

    store = synth_store(tmp_path / "store", "gpt-oss-tiny", scale=1.0, block_size=8192,
                        parallelism=3, show_progress=False).path  # 24 layers x 32 experts
    other = tmp_path / "other-shape"
    config = load_config(env={}, overrides=[f"store.path={store}"])
    save_checkpoint(ExtractorCore(16, 64, 8, config.features.pca_components), other)
    Learner(16, 64, config.features.pca_components, 15, config.predictor).save(other)
    extractor = FeatureExtractorService(config, [f"ipc://{tmp_path}/ev.sock"],
                                        f"ipc://{tmp_path}/fx.sock", None, warmup=str(other))
    predictor = PredictorService(config, [f"ipc://{tmp_path}/fx.sock"],
                                 f"ipc://{tmp_path}/pr.sock", None, str(tmp_path / "ckpt"),
                                 warmup=str(other))
    try:
        assert extractor.core.features.t == 0 and extractor.core.features.L == 24
        learner = predictor._make_learner(config.features.pca_components, 15)
        assert learner.steps == 0 and predictor.resumed_from == ""
    finally:
        for service in (extractor, predictor):
            service.close_sockets()
            service.ctx.term()
