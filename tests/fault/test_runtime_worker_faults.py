"""The trace worker under faults, against a real cache manager: a block that fails its checksum
costs the tokens that need it (skipped, counted, reported once per expert), not the replay; a
cache manager that restarts is reconnected to and the token in progress done again; a worker
frozen past the heartbeat timeout learns it lost its pins, reconnects and finishes."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import numpy as np

from common.cache_client import CacheClient
from common.traces import Trace, save_trace
from flashmoe.runtime.launch import child_env, cli_command
from services.inference_worker.process import TraceWorker
from tests.support.stores import flip_byte
from tests.support.manager import ManagerHandle

BAD = (1, 3)  # (layer, expert) whose block is damaged


def routing(rows: list[list[list[int]]]) -> Trace:
    """A trace of the tiny store's shape (2 MoE layers, 8 experts, top-2) with these rows."""
    experts = np.array(rows, dtype=np.int16)
    return Trace("faults", experts, np.array([0, len(rows)]), 8, "tiny")


GOOD = [[0, 1], [2, 4]]
USES_BAD = [[0, 1], [2, 3]]


def test_a_corrupt_block_skips_the_tokens_that_need_it_and_the_replay_goes_on(store_copy,
                                                                                start_manager):
    flip_byte(store_copy, *BAD, block_index=0)
    manager = start_manager(store_copy)
    trace = routing([GOOD, USES_BAD, GOOD, USES_BAD, GOOD])
    with CacheClient(manager.endpoint) as client:
        worker = TraceWorker(client, trace, None)
        worker.replay(0, trace.n_tokens)
        assert worker.figures() == {"tokens": 3, "tokens_failed": 2, "reconnects": 0,
                                    "failed_experts": [list(BAD)]}
        stats = client.stats()
    assert stats["n_checksum_error"] >= 2 and manager.proc.poll() is None


def test_a_restarted_cache_manager_is_reconnected_to_and_the_token_done_again(tiny_store,
                                                                              tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir()
    managers = [ManagerHandle(tiny_store, runtime, [])]
    trace = routing([GOOD] * 6)
    try:
        first = CacheClient(managers[0].endpoint)

        def reconnect():
            return CacheClient(managers[-1].endpoint)

        worker = TraceWorker(first, trace, None, reconnect=reconnect)
        worker.replay(0, 3)
        managers[0].stop()  # a restart: the old one gone, a new one on the same endpoint
        managers.append(ManagerHandle(tiny_store, runtime, []))
        worker.replay(3, 6)
        assert (worker.tokens, worker.tokens_failed, worker.reconnects) == (6, 0, 1)
        assert worker.client.stats()["n_acquire"] == 3 * trace.num_layers
        worker.client.close()
    finally:
        for manager in managers:
            manager.stop()


def test_a_worker_frozen_past_the_heartbeat_timeout_reconnects_and_finishes(tiny_store,
                                                                            tmp_path,
                                                                            start_manager):
    """The cache manager drops the frozen worker and tells it so at its next request
    (``PinsLost``); the worker reconnects and does the token again."""
    beat = ["ipc.heartbeat_interval_s=0.2", "ipc.heartbeat_timeout_s=1"]
    manager = start_manager(tiny_store, *beat)
    path = tmp_path / "trace.npz"
    save_trace(routing([GOOD, [[1, 2], [5, 6]]] * 100), path)
    out = tmp_path / "worker.json"
    cmd = cli_command("trace-worker", "--cache", manager.endpoint, "--trace", str(path),
                      "--token-ms", "20", "--json", str(out),
                      "--set", f"store.path={tiny_store}",
                      *[word for item in beat for word in ("--set", item)])
    proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while manager.stats()["n_acquire"] < 10:  # replaying
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        proc.send_signal(signal.SIGSTOP)
        manager.wait_for(lambda s: s["workers"] == 0,
                         what="the frozen worker dropped")
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(timeout=120) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    figures = json.loads(out.read_text())
    assert figures["tokens"] == 200 and figures["reconnects"] >= 1


def test_a_refused_handshake_ends_the_worker_with_one_line_and_status_2(tiny_store, tmp_path,
                                                                       start_manager):
    """Another config (or, with the cache manager's shape check, another model's shape):
    restarting cannot help, so the worker exits 2 (no traceback) for its supervisor."""
    manager = start_manager(tiny_store)
    path = tmp_path / "trace.npz"
    save_trace(routing([GOOD] * 4), path)
    done = subprocess.run(cli_command("trace-worker", "--cache", manager.endpoint, "--trace",
                                      str(path), "--set", "cache.capacity_experts=7"),
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "configuration differs" in done.stderr


def test_a_trace_of_another_shape_is_refused_at_the_handshake_with_both_shapes(tiny_store,
                                                                               tmp_path,
                                                                               start_manager):
    """The worker sends its trace's shape in the handshake; the cache manager refuses
    another store's shape with both in the message, and stays up."""
    manager = start_manager(tiny_store)
    path = tmp_path / "trace.npz"
    rows = [[[0, 1], [2, 4], [5, 6]]] * 4  # three MoE layers: the store has two
    save_trace(Trace("three-layers", np.array(rows, dtype=np.int16), np.array([0, 4]), 8,
                     "other"), path)
    done = subprocess.run(cli_command("trace-worker", "--cache", manager.endpoint, "--trace",
                                      str(path)),
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "'layers': 3" in done.stderr and "'layers': 2" in done.stderr
    assert manager.proc.poll() is None


def test_a_looping_worker_keeps_a_bounded_record_of_its_step_times(tiny_store, start_manager):
    """A --loop replay keeps the newest step times for its summary (TOKEN_MS_KEPT): it appended
    one a token for as long as it ran (the soak saw the worker grow). A bounded replay keeps
    them all (e2e-bench's tokens/s is their sum)."""
    manager = start_manager(tiny_store)
    trace = routing([GOOD] * 5)
    with CacheClient(manager.endpoint) as client:
        looping = TraceWorker(client, trace, None, step_times_kept=4)
        for _ in range(3):
            looping.replay(0, trace.n_tokens)
        looping.finish()
        client.release()
        bounded = TraceWorker(client, trace, None)
        for _ in range(3):
            bounded.replay(0, trace.n_tokens)
        bounded.finish()
    assert looping.tokens == 15 and len(looping.token_ms) == 4 and looping._timed == 15
    assert bounded.tokens == 15 and len(bounded.token_ms) == 15
