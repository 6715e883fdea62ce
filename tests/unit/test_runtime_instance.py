"""One instance per home and runtime folder, kept private: the home's lock, the runtime folder's
mode and owner, the socket files a run makes (stale ones swept, live ones refused, others'
never removed), the panel's exit noticed at once, and `run`'s figures (whole tokens, one
definition of tokens/s in the progress lines and the summary)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest

from common.config import load_config
from flashmoe.runtime.launch import (HomeInUse, Launcher, RuntimeDirError, child_env, lock_home,
                                     private_runtime_dir)
from flashmoe.runtime.run import Progress, end_runtime, synth_store_made, wait_panel_url
from flashmoe.runtime.supervisor import (ServiceSpec, SupervisionError, Supervisor,
                                         sweep_stale_sockets)
from tests.integration.test_run_user_store import tiny_trace


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_second_instance_on_a_home_is_refused_with_the_pid_of_the_first(tmp_path):
    home = tmp_path / "home"
    first = lock_home(home, "run")
    with pytest.raises(HomeInUse, match=rf"in use by another FlashMoE instance \(pid "
                                        rf"{os.getpid()}\)"):
        lock_home(home, "serve")
    first.close()
    lock_home(home, "serve").close()  # free again once the first let go


def test_run_on_a_home_in_use_exits_2_with_one_line(tiny_store, tmp_path):
    home = tmp_path / "home"
    trace = tiny_trace(tmp_path / "tiny.npz")
    held = lock_home(home, "run")
    try:
        done = subprocess.run([sys.executable, "-m", "flashmoe", "run", "--store",
                               str(tiny_store), "--home", str(home), "--trace", str(trace),
                               "--tokens", "5",
                               "--set", "panel.port=0"], env=child_env(), capture_output=True,
                              text=True, timeout=300)
    finally:
        held.close()
    assert done.returncode == 2, done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert f"pid {os.getpid()}" in line and "--home" in line


def test_a_runtime_folder_is_forced_private_and_its_files_too(tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o755)
    os.chmod(runtime, 0o755)
    (runtime / "config.json").write_text("{}")
    os.chmod(runtime / "config.json", 0o644)
    launcher = Launcher(load_config(env={}), runtime)
    assert mode(runtime) == 0o700
    assert mode(launcher.config_path) == 0o600
    proc = launcher.start_plain("probe", ["--version"])  # a child's log, and what it makes
    proc.wait(timeout=120)
    assert mode(runtime / "probe.log") == 0o600


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a folder to another user")
def test_a_runtime_folder_of_another_user_is_refused(tmp_path):
    runtime = tmp_path / "theirs"
    runtime.mkdir()
    os.chown(runtime, 65534, 65534)
    with pytest.raises(RuntimeDirError, match="belongs to uid 65534"):
        private_runtime_dir(runtime)


def test_a_link_as_runtime_folder_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(RuntimeDirError, match="link"):
        private_runtime_dir(tmp_path / "link")


def unix_listener(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(1)
    return sock


def test_stale_socket_files_are_swept_and_live_ones_refused(tmp_path):
    stale = tmp_path / "cache_manager.sock"
    unix_listener(stale).close()  # the file stays, nothing answers: a killed run's
    assert sweep_stale_sockets([stale, tmp_path / "absent.sock"]) == [stale]
    assert not stale.exists()
    live = tmp_path / "predictor.sock"
    with unix_listener(live):
        with pytest.raises(SupervisionError, match="in use by a live process"):
            sweep_stale_sockets([live])
        assert live.exists()


def test_the_supervisor_removes_only_the_socket_files_of_its_services(tmp_path):
    specs = [ServiceSpec("cache_manager", ["serve-cache"]),
             ServiceSpec("worker", ["trace-worker"], health_checked=False,
                         sockets=[f"ipc://{tmp_path}/worker.events.sock"])]
    supervisor = Supervisor(load_config(env={}), tmp_path, specs)
    ours = [tmp_path / name for name in ("cache_manager.sock", "cache_manager.control.sock",
                                         "worker.events.sock")]
    assert sorted(supervisor.socket_paths()) == sorted(ours)
    for path in [*ours, tmp_path / "other.sock"]:
        path.write_text("")
    supervisor.stop()
    assert not any(path.exists() for path in ours)
    assert (tmp_path / "other.sock").exists()  # another instance's, say


def test_waiting_for_the_panel_ends_at_once_when_it_exited(tmp_path):
    assert wait_panel_url(tmp_path, timeout_s=3600, exited=lambda: 1) is None


def stats(acquires: int) -> dict:
    return {"n_acquire": acquires, "n_hit": acquires // 2, "n_miss": acquires - acquires // 2,
            "n_byte_read": 0, "prefetch_used": 0, "prefetch_issued": 0, "prefetch_wasted": 0,
            "n_hit_loading": 0, "engine": "pread", "policy": "lru"}


def test_run_counts_whole_tokens_and_one_rate_in_progress_and_summary():
    progress = Progress(layers=24)
    lines = [progress.sample(stats(n), {}, {}) for n in (0, 24 * 10 + 7, 24 * 605 + 17)]
    summary = progress.summary(stats(24 * 605 + 17), {}, {})
    assert [line["tokens"] for line in lines] == [0, 10, 605]
    assert summary["tokens"] == 605 and isinstance(summary["tokens"], int)
    assert summary["tokens_per_s"] == round(lines[-1]["tokens_per_s"], 2)


def test_the_runtime_folder_goes_on_a_clean_end_and_stays_when_asked_or_after_a_failure(
        tmp_path):
    said = []
    for keep in (True, False):
        runtime = tmp_path / f"rt-{keep}"
        runtime.mkdir()
        end_runtime(runtime, True, keep, said.append, "run")
        assert runtime.exists() == keep
    assert said == [f"[run] logs kept in {tmp_path / 'rt-True'}"]
    given = tmp_path / "given"
    given.mkdir()
    end_runtime(given, False, False, said.append, "run")  # a given ipc.runtime_dir stays
    assert given.exists()


def test_the_default_store_counts_as_made_only_when_it_matches(tmp_path):
    import json

    from flashmoe.runtime.run import DEFAULT_SCALE

    config = load_config(env={})
    assert not synth_store_made(tmp_path, config)
    made = {"shape": "gpt-oss-20b", "scale": DEFAULT_SCALE, "seed": 0,
            "block_size": config.store.block_size, "parallelism": config.store.parallelism}
    (tmp_path / "config.json").write_text(json.dumps({"flashmoe_synthetic": made}))
    assert synth_store_made(tmp_path, config)
    made["scale"] = 1.0
    (tmp_path / "config.json").write_text(json.dumps({"flashmoe_synthetic": made}))
    assert not synth_store_made(tmp_path, config)


def test_a_trace_of_another_shape_than_the_default_store_is_refused_in_one_line(tmp_path):
    from common.traces import TraceError, load_trace
    from flashmoe.runtime.run import check_trace_fits

    check_trace_fits(load_trace("gptoss20b-sample:eval", tmp_path), None)  # the default's own
    trace = load_trace(str(tiny_trace(tmp_path / "tiny.npz")), tmp_path)
    with pytest.raises(TraceError) as refused:
        check_trace_fits(trace, None)
    message = str(refused.value)
    assert "(tiny: 2 MoE layers x 8 experts, top-2)" in message and "\n" not in message
    assert "the default store (24 MoE layers x 32 experts, top-4)" in message


def test_a_service_refused_with_status_2_is_not_restarted_and_the_run_says_why(tmp_path):
    import time

    spec = ServiceSpec("worker", ["no-such-command"], health_checked=False)  # argparse: 2
    supervisor = Supervisor(load_config(env={}), tmp_path, [spec])
    supervisor.start_all()
    try:
        deadline = time.monotonic() + 120
        with pytest.raises(SupervisionError, match="was refused") as refused:
            while time.monotonic() < deadline:
                supervisor.poll()
                time.sleep(0.1)
    finally:
        supervisor.stop()
    assert "invalid choice" in str(refused.value) and "\n" not in str(refused.value)
    assert supervisor.restarts() == {"worker": 0}
