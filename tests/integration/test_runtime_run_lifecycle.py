"""`flashmoe run` from start to end as a user meets it: a corrupt block costs the tokens that
need it, not the run; the figures are whole tokens and one rate; the runtime folder goes at a
clean end; Ctrl-C during start-up is one line and leaves nothing; after `kill -9` of `run` its
children die and the next run on the same folder sweeps the socket files left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashmoe.runtime.launch import child_env
from tests.support.stores import flip_byte
from tests.fault.test_run_faults import pids_of_run
from tests.integration.test_run_user_store import tiny_trace
from tests.support.run_output import RunOutput, summary_of

pytestmark = pytest.mark.slow


def run_command(store, home, trace, *words) -> list[str]:
    return [sys.executable, "-m", "flashmoe", "run", "--store", str(store), "--home",
            str(home), "--trace", str(trace), "--capacity", "8", "--set", "panel.port=0",
            *words]


def clean_env() -> dict:
    return {k: v for k, v in child_env().items() if not k.startswith("FLASHMOE_")}


def wait_gone(runtime: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pids_of_run(runtime):
        assert time.monotonic() < deadline, pids_of_run(runtime)
        time.sleep(0.2)


def test_a_corrupt_block_costs_tokens_not_the_run_and_the_folder_goes_at_the_end(store_copy,
                                                                                 tmp_path):
    flip_byte(store_copy, 1, 3, block_index=0)
    trace = tiny_trace(tmp_path / "tiny.npz")
    done = subprocess.run(run_command(store_copy, tmp_path / "home", trace, "--tokens", "40"),
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "[run] worker finished" in out
    summary = summary_of(done.stdout)
    assert int(summary["tokens_failed"]) > 0 and summary["restarts"].count(": 0") == 5
    # whole tokens, and the last progress line's rate is the summary's
    assert re.fullmatch(r"\d+", summary["tokens"])
    last = [line for line in done.stdout.splitlines() if re.match(r"\[run\]\s+\d+ tokens", line)]
    assert last, out[-3000:]
    shown = re.search(r"\[run\]\s+(\d+) tokens\s+([\d.]+) tok/s", last[-1])
    assert shown.groups() == (summary["tokens"], f"{float(summary['tokens_per_s']):.2f}")
    runtime = Path(re.search(r"runtime folder (\S+);", out).group(1))
    assert not runtime.exists()  # a clean end: nothing left in /tmp
    assert "first use only" not in out


def test_ctrl_c_during_start_up_is_one_line_and_leaves_nothing(tiny_store, tmp_path):
    trace = tiny_trace(tmp_path / "tiny.npz")
    runtime = tmp_path / "rt"
    proc = subprocess.Popen(run_command(tiny_store, tmp_path / "home", trace, "--loop", "--set",
                                        f"ipc.runtime_dir={runtime}"),
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if "[run] runtime folder" in line:
                break
        proc.send_signal(signal.SIGINT)  # the services are starting
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, stdout + stderr
    assert stderr.strip().splitlines() == [
        "flashmoe run: stopped by SIGINT during start-up; nothing is left running"]
    assert "Traceback" not in stdout
    wait_gone(runtime)
    assert not list(runtime.glob("*.sock"))


def test_after_kill_9_of_run_its_children_die_and_the_next_run_sweeps_its_sockets(tiny_store,
                                                                                  tmp_path):
    trace = tiny_trace(tmp_path / "tiny.npz")
    runtime = tmp_path / "rt"
    words = ("--set", f"ipc.runtime_dir={runtime}")
    proc = subprocess.Popen(run_command(tiny_store, tmp_path / "home", trace, "--loop", *words),
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    out = RunOutput(proc)
    try:
        out.wait_for(r"services up")
    finally:
        proc.kill()
        proc.wait()
    wait_gone(runtime)  # the parent-death signal took every child with it
    assert list(runtime.glob("*.sock"))  # what kill -9 leaves
    done = subprocess.run(run_command(tiny_store, tmp_path / "home", trace, "--tokens", "10",
                                      *words),
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert not list(runtime.glob("*.sock"))
