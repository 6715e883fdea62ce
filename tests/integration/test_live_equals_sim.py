"""The simulator's core mode is the live system: a trace-driven worker process replays a
slice of the real gpt-oss-20b trace through a live cache-manager process over real sockets
(real reads of a real store of that model's shape), and its hit, miss and load counts equal
`flashmoe bench --mode core` on the same slice, policy and capacity."""

import json
import signal
import subprocess

import numpy as np
import pytest

from common.traces import Trace, load_gptoss20b
from flashmoe.sim.device_model import DEVICES
from flashmoe.runtime.launch import child_env, cli_command
from flashmoe.sim.replay import replay_core
from flashmoe.tools.synth_store import synth_store

pytestmark = pytest.mark.traces
TOKENS = 120


@pytest.fixture(scope="module")
def gptoss_tiny_store(tmp_path_factory):
    return synth_store(tmp_path_factory.mktemp("synth") / "store", "gpt-oss-tiny", scale=1.0,
                       block_size=8192, parallelism=3, show_progress=False).path


def replay_live(manager, tmp_path) -> tuple[dict, Trace]:
    """The first TOKENS of the eval split through ``manager`` by a trace-worker process: its
    stats, and the slice of the trace it replayed."""
    out = tmp_path / "live.json"
    subprocess.run(cli_command("trace-worker", "--cache", manager.endpoint, "--trace",
                               "gptoss20b:eval", "--tokens", str(TOKENS), "--json", str(out)),
                   env=child_env(), check=True, timeout=300, capture_output=True)
    trace = load_gptoss20b("eval")
    piece = Trace("slice", trace.experts[:TOKENS], np.array([0, TOKENS]), 32, trace.model)
    return json.loads(out.read_text()), piece


@pytest.mark.parametrize("policy, capacity", [("lru", 96), ("arc", 48), ("s3fifo", 192),
                                              ("lirs", 96), ("nextuse", 96)])
def test_live_hits_and_misses_equal_the_simulator(policy, capacity, gptoss_tiny_store,
                                                  start_manager, tmp_path):
    manager = start_manager(gptoss_tiny_store, f"cache.policy={policy}",
                            f"cache.capacity_experts={capacity}", "prefetch.inline=false",
                            "prefetch.learned=0")
    live, piece = replay_live(manager, tmp_path)
    sim = replay_core(policy, capacity, piece, "global", DEVICES["orin-980pro"], 1, 0.0)
    for key in ("n_hit", "n_miss", "n_load", "n_evict"):
        assert live[key] == sim.stats[key], (key, live[key], sim.stats[key])
    assert live["n_hit"] + live["n_miss"] == TOKENS * 24 * 4 and live["n_checksum_error"] == 0


def test_a_looping_worker_stops_on_sigterm_and_reports(gptoss_tiny_store, start_manager,
                                                       tmp_path):
    """SIGTERM ends the replay after the token in progress: the worker releases its pins,
    writes the cache manager's stats and exits 0 (the service skeleton's stop)."""
    manager = start_manager(gptoss_tiny_store)
    out = tmp_path / "worker.json"
    proc = subprocess.Popen(cli_command("trace-worker", "--cache", manager.endpoint, "--trace",
                                        "gptoss20b:eval", "--tokens", "5", "--loop", "--json",
                                        str(out)),
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        manager.wait_for(lambda s: s["n_hit"] + s["n_miss"] > 5 * 24 * 4, timeout_s=120,
                         what="the worker looping over its slice")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "trace_worker stopped after" in err
    stats = json.loads(out.read_text())  # the cache manager's, fetched as the worker stopped
    assert stats["n_hit"] + stats["n_miss"] > 5 * 24 * 4  # (which are hits is timing's)


@pytest.mark.parametrize("precision, split", [("int4", None), ("random", None),
                                              ("random", (0.0, 0.5, 0.5))])
def test_live_equals_the_simulator_with_experts_at_their_precisions(precision, split, tmp_path,
                                                                    start_manager):
    """One bookkeeping for every precision: the same layout of pools (the store's copies'
    sizes), the same draws, the same counts, per precision too (and without a native pool
    where the split gives it nothing)."""
    from common.arena import plan_layout
    from common.store import ExpertStore
    from flashmoe.tools.store_writer import write_copies

    store = synth_store(tmp_path / "store", "gpt-oss-tiny", scale=1.0, block_size=8192,
                        parallelism=3, show_progress=False).path
    write_copies(store, ["int8", "int4"], show_progress=False)
    manager = start_manager(store, "cache.policy=lru", "cache.capacity_experts=64",
                            f"cache.precision={precision}", "cache.precision_fractions=1,1,2",
                            "prefetch.inline=false", "prefetch.learned=0",
                            *([f"cache.precision_split={','.join(map(str, split))}"]
                              if split else []))
    live, piece = replay_live(manager, tmp_path)
    with ExpertStore.open(store) as opened:
        layout = plan_layout(opened, 64, precision, split)  # (None: the default)
        expert_bytes = opened.manifest.max_expert_bytes
    if split:
        assert [p.precision for p in layout.pools] == ["int8", "int4"]
    sim = replay_core("lru", 64, piece, "global", DEVICES["orin-980pro"], expert_bytes, 0.0,
                      precision=precision, fractions=(1.0, 1.0, 2.0), layout=layout)
    keys = ["n_hit", "n_miss", "n_load", "n_evict"] + [f"n_load_{p.precision}"
                                                       for p in layout.pools]
    for key in keys:
        assert live[key] == sim.stats[key], (key, live[key], sim.stats[key])
    assert live["n_checksum_error"] == 0
