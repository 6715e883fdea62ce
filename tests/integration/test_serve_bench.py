"""`flashmoe serve-bench` against a real `flashmoe serve` of a tiny store: the OpenAI client
streams every request to its last token, and the report has the promised keys with sane
values. No timing is asserted."""

import json
import subprocess

import pytest

from flashmoe.runtime.launch import child_env, cli_command
from tests.support.serving import Server

pytestmark = pytest.mark.slow
KEYS = {"concurrency", "requests", "failed", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50",
        "itl_ms_p99", "tpot_ms_p50", "tokens_per_s", "requests_per_s", "hit_rate",
        "stall_free_rate", "router_lookahead_recall", "estimate", "estimates_used",
        "predictor_recall", "max_batch"}


@pytest.fixture
def server(tiny_store, tmp_path):
    """A `flashmoe serve` of the tiny store on a free port; its URL once /health is 200."""
    with Server(tiny_store, tmp_path / "home", "cache.capacity_experts=6") as s:
        yield s.url


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
