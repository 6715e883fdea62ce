"""`flashmoe run` under faults: kill -9 the worker, the cache manager, the predictor and the
feature extractor in turn; each is restarted and the run goes on; SIGTERM then leaves no
process, socket file or shared-memory arena behind."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common.config import load_config
from common.traces import load_gptoss20b
from flashmoe.runtime.launch import child_env, cli_command
from flashmoe.sim.learning import warmup
from flashmoe.tools.synth_store import synth_store
from tests.support.run_output import RunOutput
from tests.support.traces import sequences_slice

pytestmark = pytest.mark.traces
SERVICES = ("worker", "cache_manager", "predictor", "feature_extractor")


def pids_of_run(runtime: Path) -> dict[str, int]:
    """The live processes whose command line names the run's runtime folder."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(runtime) in cmdline and "flashmoe" in cmdline:
            found[entry.name] = cmdline
    return found


def test_each_service_killed_in_turn_is_restarted_and_nothing_is_left(tmp_path):
    store = synth_store(tmp_path / "store", "gpt-oss-tiny", scale=1.0, block_size=8192,
                        parallelism=2, show_progress=False).path
    ckpt = tmp_path / "warmup"
    warmup(sequences_slice(load_gptoss20b("train"), "train-slice", 0, 2), load_config(env={}),
           ckpt, passes=1)
    runtime = tmp_path / "rt"
    runtime.mkdir()
    arenas_before = shm_arenas()
    cmd = cli_command("run", "--store", str(store), "--warmup", str(ckpt), "--loop",
                      "--capacity", "96", "--token-ms", "20", "--json",
                      str(tmp_path / "summary.json"), "--set", f"ipc.runtime_dir={runtime}",
                      "--set", "panel.port=0")
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = RunOutput(proc)
    try:
        pids = json.loads(out.wait_for(r"services up: (\{.*\})").group(1).replace("'", '"'))
        managers = {pids["cache_manager"]}  # every cache manager of the run (its arenas' names)
        out.wait_for(r"\[run\]\s+[\d.]+ tokens")
        for name in SERVICES:
            mark = len(out.lines)
            os.kill(pids[name], signal.SIGKILL)
            out.wait_for(rf"{name} restarted", after=mark, timeout_s=60)
            # The run goes on: tokens keep coming after the restart.
            before = out.tokens()
            deadline = time.monotonic() + 90
            while out.tokens() <= before:
                assert time.monotonic() < deadline, "\n".join(out.lines[-30:])
                assert proc.poll() is None, "\n".join(out.lines[-30:])
                time.sleep(0.2)
            pids.update(_pids_now(runtime))
            managers.add(pids["cache_manager"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "\n".join(out.lines[-30:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert all(summary["restarts"][name] >= 1 for name in SERVICES), summary["restarts"]
    time.sleep(0.5)
    assert pids_of_run(runtime) == {}
    assert not list(runtime.glob("*.sock")) and not list(runtime.glob("**/*.sock"))
    # No arena of this run left behind (others' jobs on this machine may make their own).
    assert not {name for name in shm_arenas() - arenas_before
                if any(f"-{pid}-" in name for pid in managers)}


def _pids_now(runtime: Path) -> dict[str, int]:
    """The current pid of each service, from the processes that name the runtime folder."""
    markers = {"cache_manager": "serve-cache", "feature_extractor": "serve-features",
               "predictor": "serve-predictor", "worker": "trace-worker"}
    now = {}
    for pid, cmdline in pids_of_run(runtime).items():
        for name, marker in markers.items():
            if f" {marker} " in f" {cmdline} ":
                now[name] = int(pid)
    return now


def shm_arenas() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("flashmoe")}
