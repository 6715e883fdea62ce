"""`flashmoe run --store` with a converted model's store: a trace of the store's shape is
replayed and a warm-up of another shape is not used (the learned policy starts cold, and the run
says so); a trace of another shape is refused before anything starts, without a traceback."""

import subprocess
import sys

import numpy as np
import pytest

from common.config import load_config
from common.traces import Trace, save_trace
from flashmoe.cli.main import main as cli
from flashmoe.runtime.launch import child_env
from flashmoe.runtime.run import prepare
from flashmoe.sim.learning import Learning
from tests.support.run_output import summary_of

LAYERS, EXPERTS, TOP_K = 2, 8, 2  # the tiny store's


def tiny_trace(path):
    """Random routing of the tiny store's shape: two sequences of 30 tokens."""
    rng = np.random.default_rng(0)
    experts = np.stack([np.stack([rng.choice(EXPERTS, TOP_K, replace=False)
                                  for _ in range(LAYERS)]) for _ in range(60)])
    save_trace(Trace("tiny", experts.astype(np.int16), np.array([0, 30, 60]), EXPERTS, "tiny"),
               path)
    return path


def test_a_trace_of_another_shape_is_refused_before_anything_starts(tiny_store, tmp_path,
                                                                    capsys):
    home = tmp_path / "home"
    assert cli(["run", "--store", str(tiny_store), "--home", str(home), "--trace",
                "gptoss20b-sample:eval"]) == 2
    err = capsys.readouterr().err
    assert "gptoss20b-sample:eval (gpt-oss-20b: 24 MoE layers x 32 experts, top-4)" in err
    assert f"the store {tiny_store} (2 MoE layers x 8 experts, top-2)" in err
    assert "flashmoe trace record" in err and "--trace" in err
    assert "Traceback" not in err and not home.exists()  # nothing made


def test_a_warmup_of_another_shape_than_the_store_is_not_used(tiny_store, tmp_path):
    config, said = load_config(env={}), []
    home = tmp_path / "home"
    # the default warm-up (gpt-oss-20b's) is not made for a store of another model
    assert prepare(home, config, str(tiny_store), None, tmp_path, said.append) == \
        (str(tiny_store), None)
    assert "the default one is of gpt-oss-20b's shape (24 MoE layers x 32 experts)" in said[-1]
    assert "starts cold" in said[-1] and not (home / "warmup").exists()
    other, fits = tmp_path / "other", tmp_path / "fits"
    Learning.create(3, 4, TOP_K, config).save(other)
    Learning.create(LAYERS, EXPERTS, TOP_K, config).save(fits)
    assert prepare(home, config, str(tiny_store), str(other), tmp_path, said.append)[1] is None
    assert f"not using the warm-up {other}: it is of 3 MoE layers x 4 experts" in said[-1]
    assert prepare(home, config, str(tiny_store), str(fits), tmp_path, said.append)[1] == \
        str(fits)
    assert len(said) == 2


@pytest.mark.slow
def test_run_replays_a_trace_of_the_stores_shape_from_a_cold_start(tiny_store, tmp_path):
    trace = tiny_trace(tmp_path / "tiny.npz")
    env = {k: v for k, v in child_env().items() if not k.startswith("FLASHMOE_")}
    done = subprocess.run([sys.executable, "-m", "flashmoe", "run", "--store", str(tiny_store),
                           "--home", str(tmp_path / "home"), "--trace", str(trace), "--tokens",
                           "40", "--capacity", "8", "--set", "panel.port=0"],
                          env=env,
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "no warm-up" in out and "the learned policy starts cold" in out
    assert "Traceback" not in out and "[run] worker finished" in out
    summary = summary_of(done.stdout)
    assert 0.0 < float(summary["hit_rate"]) <= 1.0 and summary["restarts"].count(": 0") == 5
