"""The benchmark programs run end to end and write the JSON they promise (no timings asserted)."""

import json
import shutil

import pytest

from common.traces import DEFAULT_TRACES_DIR
from flashmoe.cli import main as cli
from tests.conftest import uring_available

URING_OK, URING_WHY = uring_available()


def test_io_bench_writes_every_key(tiny_store, tmp_path, capsys):
    engines = "uring,pread" if URING_OK else "pread"
    out = tmp_path / "io.json"
    assert cli(["io-bench", str(tiny_store), "--engine", engines, "--depth", "1,4",
                "--repeat", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["runs"]) == 2 * len(engines.split(","))
    for run in doc["runs"]:
        assert {"engine", "block_size", "depth", "mb_per_s", "p50_us", "p99_us",
                "ceiling_mb_per_s", "ratio"} <= set(run)
        assert run["mb_per_s"] > 0 and run["p99_us"] >= run["p50_us"] > 0
        if shutil.which("fio"):
            assert run["ceiling_mb_per_s"] > 0
            assert run["ratio"] == pytest.approx(run["mb_per_s"] / run["ceiling_mb_per_s"], rel=0.01)
    assert "engine" in capsys.readouterr().out


def test_single_run_json_has_the_keys_at_top_level(tiny_store, tmp_path):
    out = tmp_path / "io.json"
    assert cli(["io-bench", str(tiny_store), "--engine", "pread", "--depth", "2", "--repeat", "1",
                "--no-fio", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["engine"] == "pread" and doc["depth"] == 2 and doc["ceiling_mb_per_s"] is None


def test_acquire_bench_reports_round_trip_and_floor(tiny_store, tmp_path):
    out = tmp_path / "acq.json"
    assert cli(["acquire-bench", str(tiny_store), "--iterations", "200", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["iterations"] == 200 and doc["n_miss"] == doc["experts_per_acquire"]
    assert doc["n_hit"] == 200 * doc["experts_per_acquire"]
    assert doc["median_us"] > 0 and doc["transport_floor"]["median_us"] > 0
    assert doc["core_only"]["median_us"] > 0


@pytest.mark.skipif(not (DEFAULT_TRACES_DIR / "warp").is_dir(),
                    reason=f"shared traces not found at {DEFAULT_TRACES_DIR}")
def test_bench_cli_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert cli(["bench", "--trace", "warp:olmoe", "--scope", "layer", "--capacity", "0.125,0.25",
                "--policies", "lru,s3fifo,belady", "--json", str(out), "--plot", str(png),
                "--quiet"]) == 0
    doc = json.loads(out.read_text())
    assert [r["capacity"] for r in doc["results"]] == [8, 8, 8, 16, 16, 16]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "device model orin-980pro" in capsys.readouterr().out
    assert cli(["bench", "--trace", "warp:olmoe", "--capacity", "0.0001", "--quiet"]) == 2
    assert "at least one expert" in capsys.readouterr().err
    assert cli(["bench", "--trace", "warp:olmoe", "--policies", "lru,nope", "--quiet"]) == 2
    assert "unknown policies" in capsys.readouterr().err
