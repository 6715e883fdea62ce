"""The benchmark programs run end to end and write the JSON they promise (no timings asserted)."""

import json

import pytest

from flashmoe.cli import main as cli


def test_acquire_bench_reports_round_trip_and_floor(tiny_store, tmp_path):
    out = tmp_path / "acq.json"
    assert cli(["acquire-bench", str(tiny_store), "--iterations", "200", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    k = doc["experts_per_acquire"]
    # Every timed acquire of the hit worker is a hit; the streamer's acquires all miss.
    assert doc["iterations"] == 200 and doc["n_hit"] == 2 * 200 * k
    assert doc["n_miss"] > k and doc["n_byte_read"] > 0
    assert doc["median_us"] > 0 and doc["transport_floor"]["median_us"] > 0
    assert doc["core_only"]["median_us"] > 0
    assert doc["under_misses"]["p99_us"] > 0 and doc["under_misses"]["miss_acquires_per_s"] > 0
    # Each figure is the median over the interleaved rounds, inside its spread.
    assert doc["rounds"] == 5
    for fig in (doc, doc["transport_floor"], doc["under_misses"]):
        lo, hi = fig["p99_spread_us"]
        assert lo <= fig["p99_us"] <= hi
        lo, hi = fig["median_spread_us"]
        assert lo <= fig["median_us"] <= hi


@pytest.mark.traces
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


@pytest.mark.traces
def test_bus_bench_counts_every_stage(tmp_path):
    out = tmp_path / "bus.json"
    assert cli(["bus-bench", "--events", "2000", "--rates", "50", "--seconds", "2",
                "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["raw"]["received"] + doc["raw"]["lost"] == 2000
    assert doc["raw"]["accesses_per_s"] > 0
    (run,) = doc["pipeline"]
    assert run["events"] == 100 and run["extractor_events"] == 100
    assert run["predictor_batches"] == run["batches"] and run["lost"] == 0
