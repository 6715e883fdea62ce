"""`flashmoe io-bench` end to end on real files: every key in the JSON, medians with their
spread, the fio ceiling as the better of the block size and the expert extent, extra contenders
interleaved in the same rounds. No timing is asserted; fio figures skip when fio is missing."""

import contextlib
import json

import pytest

from common.store import ExpertStore
from flashmoe.bench import io as io_bench
from flashmoe.cli import main as cli
from flashmoe.tools.convert import convert_checkpoint
from tests.support.uring import uring_available

URING_OK, URING_WHY = uring_available()
FIO_MISSING = io_bench.fio_missing()
RUN_KEYS = {"engine", "block_size", "depth", "mb_per_s", "mb_per_s_min", "mb_per_s_max",
            "p50_us", "p99_us", "ceiling_mb_per_s", "ceiling_min", "ceiling_max", "ceiling_bs",
            "ratio", "fio_block_mb_per_s", "fio_extent_mb_per_s", "extent_bytes", "rounds"}


def needs_fio():
    if FIO_MISSING:
        pytest.skip(f"no fio ceiling to check: {FIO_MISSING}")


@pytest.mark.parametrize("engines", ["pread", pytest.param("uring,pread",
                                                           marks=pytest.mark.uring)])
def test_io_bench_writes_every_key(tiny_store, tmp_path, capsys, engines):
    if "uring" in engines and not URING_OK:
        pytest.skip(f"io_uring helper unavailable: {URING_WHY}")
    out = tmp_path / "io.json"
    assert cli(["io-bench", str(tiny_store), "--engine", engines, "--depth", "1,4",
                "--repeat", "2", "--no-fio", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["engine"], r["depth"]) for r in doc["runs"]] == \
        [(e, d) for d in (1, 4) for e in engines.split(",")]
    for run in doc["runs"]:
        assert RUN_KEYS <= set(run) and run["rounds"] == 2
        assert run["mb_per_s_min"] <= run["mb_per_s"] <= run["mb_per_s_max"]
        assert run["mb_per_s"] > 0 and run["p99_us"] >= run["p50_us"] > 0
        assert run["ceiling_mb_per_s"] is None and run["ratio"] is None
    assert "MB/s (min..max)" in capsys.readouterr().out


def test_single_run_json_has_the_keys_at_top_level(tiny_store, tmp_path):
    out = tmp_path / "io.json"
    assert cli(["io-bench", str(tiny_store), "--engine", "pread", "--depth", "2", "--repeat", "1",
                "--no-fio", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["engine"] == "pread" and doc["depth"] == 2 and doc["ceiling_mb_per_s"] is None


def test_cli_reports_the_fio_ceiling(tiny_store, tmp_path):
    needs_fio()
    out = tmp_path / "io.json"
    assert cli(["io-bench", str(tiny_store), "--engine", "pread", "--depth", "2", "--repeat", "1",
                "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["ceiling_mb_per_s"] > 0 and doc["ceiling_bs"] == doc["block_size"]
    assert doc["ratio"] == pytest.approx(doc["mb_per_s"] / doc["ceiling_mb_per_s"], rel=0.01)


@pytest.fixture
def small_block_store(tiny_checkpoints, tmp_path):
    """Blocks smaller than an expert's extent per stripe, so fio runs at two sizes."""
    out = tmp_path / "store"
    convert_checkpoint(tiny_checkpoints["qwen3_moe"], out, block_size=4096, parallelism=2,
                       show_progress=False)
    return out


def test_ceiling_is_the_better_of_block_size_and_expert_extent(small_block_store):
    needs_fio()
    store = ExpertStore.open(small_block_store)
    extent = io_bench.expert_extent_bytes(store)
    assert extent % 4096 == 0 and extent > 4096
    [run] = io_bench.io_bench(str(small_block_store), ["pread"], [2], repeat=2,
                              fio_runtime_s=0.5, fio_ramp_s=0.2)
    assert run.extent_bytes == extent and run.rounds == 2
    assert run.fio_block_mb_per_s > 0 and run.fio_extent_mb_per_s > 0
    assert run.ceiling_mb_per_s == max(run.fio_block_mb_per_s, run.fio_extent_mb_per_s)
    assert run.ceiling_bs == (4096 if run.ceiling_mb_per_s == run.fio_block_mb_per_s
                              else extent)
    assert run.ceiling_min <= run.ceiling_mb_per_s <= run.ceiling_max
    assert run.ratio == pytest.approx(run.mb_per_s / run.ceiling_mb_per_s, rel=0.01)


def test_extra_contenders_run_in_every_round_and_report_their_medians(tiny_store):
    calls = []

    def contender(name: str, speeds: list[float]):
        def one_pass():
            calls.append(name)
            return speeds[sum(c == name for c in calls) - 1], [10.0, 30.0], 4096
        return one_pass

    steady_run = contender("steady", [1.0, 5.0, 3.0] * 2)
    other_run = contender("other", [2.0] * 6)
    depths_seen = []

    def factory(run):
        def make(depth):
            depths_seen.append(depth)
            return contextlib.nullcontext(run)
        return make

    results = io_bench.io_bench(str(tiny_store), ["pread"], [1, 2], repeat=3, with_fio=False,
                                extra={"steady": factory(steady_run), "other": factory(other_run)})
    assert depths_seen == [1, 1, 2, 2]
    assert [(r.engine, r.depth) for r in results] == \
        [(e, d) for d in (1, 2) for e in ("pread", "steady", "other")]
    steady = [r for r in results if r.engine == "steady"]
    assert [(r.mb_per_s, r.mb_per_s_min, r.mb_per_s_max) for r in steady] == [(3.0, 1.0, 5.0)] * 2
    assert steady[0].p50_us == 20.0 and steady[0].bytes_read == 4096
    assert calls.count("steady") == calls.count("other") == 6
    # Interleaved: the order of the two changes between rounds.
    rounds = [tuple(c for c in calls[i:i + 2]) for i in range(0, len(calls), 2)]
    assert len(set(rounds)) == 2


def test_the_live_manager_loads_every_expert_by_prefetch_hints(tiny_store, tmp_path):
    out = tmp_path / "io.json"
    assert cli(["io-bench", str(tiny_store), "--engine", "pread", "--depth", "4", "--repeat",
                "1", "--no-fio", "--with-manager", "--json", str(out)]) == 0
    runs = {r["engine"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"pread", "manager-prefetch"}
    assert runs["manager-prefetch"]["bytes_read"] == runs["pread"]["bytes_read"] > 0
