"""`flashmoe serve-bench` against a real `flashmoe serve` of a tiny store: the OpenAI client
streams every request to its last token, and the report has the promised keys with sane
values. No timing is asserted."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from flashmoe.runtime.launch import child_env, cli_command

pytestmark = pytest.mark.slow
READY_S = 45.0
KEYS = {"concurrency", "requests", "failed", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50",
        "itl_ms_p99", "tpot_ms_p50", "tokens_per_s", "requests_per_s", "hit_rate",
        "stall_free_rate", "router_lookahead_recall", "estimate", "estimates_used",
        "predictor_recall", "max_batch"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL if it is still there after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything of the group left behind
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture
def server(tiny_store, tmp_path):
    """A `flashmoe serve` of the tiny store on a free port; its URL once /health is 200."""
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        cli_command("serve", str(tiny_store), "--home", str(tmp_path / "home"),
                    "--set", f"serve.port={port}", "--set", "panel.port=0",
                    "--set", "cache.capacity_experts=6"),
        env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_S
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        yield url
    finally:
        stop_group(proc)
        log.close()


def test_serve_bench_streams_every_request_and_reports(server, tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        cli_command("serve-bench", "--url", server, "--prompts", "4", "--concurrency", "2",
                    "--max-tokens", "6", "--json", str(out), "--plot",
                    str(tmp_path / "bench.png")),
        env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TTFT" in done.stdout
    doc = json.loads(out.read_text())
    assert {"url", "model", "prompts", "concurrency", "max_tokens", "rounds", "seed"} <= set(doc)
    assert doc["concurrency"] == [2] and doc["max_tokens"] == 6
    (row,) = doc["results"]
    assert KEYS <= set(row)
    assert row["requests"] == 4 and row["failed"] == 0
    assert row["output_tokens"] == 4 * 6  # ignore_eos: every request to max_tokens
    assert row["server_tokens_generated"] == 4 * 6
    assert row["tokens_per_s"] > 0 and row["requests_per_s"] > 0
    assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"]
    assert 0 < row["itl_ms_p50"] <= row["itl_ms_p99"]
    assert 0 <= row["hit_rate"] <= 1 and 0 <= row["stall_free_rate"] <= 1
    assert 1 <= row["max_batch"] <= 2
    assert (tmp_path / "bench.png").stat().st_size > 0
