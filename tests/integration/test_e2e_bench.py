"""`flashmoe e2e-bench` end to end on a tiny store: every mode runs on real files, the JSON has
the promised keys, the mmap mode is held to its budget by a memory cgroup (or is skipped with
the reason). No timing is asserted."""

import json

import pytest

from common.config import load_config
from common.traces import load_gptoss20b
from flashmoe.bench import e2e as e2e_bench
from flashmoe.sim.learning import warmup
from tests.support.traces import sequences_slice

pytestmark = pytest.mark.traces
KEYS = {"mode", "budget_fraction", "tokens_per_s", "ms_per_token_p50", "ms_per_token_p99",
        "ssd_mb_per_s", "bytes_read", "peak_pss_bytes", "stall_free_rate"}


def test_every_mode_runs_and_reports(tmp_path):
    ckpt = tmp_path / "warmup"
    warmup(sequences_slice(load_gptoss20b("train"), "train-slice", 0, 2), load_config(env={}),
           ckpt, passes=1)
    report = e2e_bench.e2e_bench(tmp_path / "work", 1.0, [0.25], 12, 1,
                                 ["flashmoe", "lru", "mmap", "ram"], str(ckpt),
                                 shape="gpt-oss-tiny")
    modes = {r["mode"]: r for r in report["results"]}
    if "mmap" in report["skipped"]:
        assert "cgroup" in report["skipped"]["mmap"]
    assert set(modes) | set(report["skipped"]) == {"flashmoe", "lru", "mmap", "ram"}
    for mode, row in modes.items():
        assert KEYS <= set(row) and row["tokens_per_s"] > 0 and row["peak_pss_bytes"] > 0
        assert (row["stall_free_rate"] is None) == (mode in ("mmap", "ram"))
        # the learner's CPU a token, beside the token time, where there is a learner
        assert (row["learner_cpu_ms_per_token"] is None) == (mode != "flashmoe")
    assert modes["flashmoe"]["learner_cpu_ms_per_token"] > 0
    assert set(modes["flashmoe"]["extra"]["learner_cpu_ms_by_stage"]) >= {"extract", "infer"}
    assert modes["lru"]["bytes_read"] > 0 and modes["flashmoe"]["bytes_read"] > 0
    text = e2e_bench.format_table(report)
    assert "flashmoe" in text and json.dumps(report)


def test_a_trace_of_another_topology_is_refused_by_name(tmp_path):
    from common.traces import TraceError

    with pytest.raises(TraceError, match="16 layers x 64 experts, top-8.*24 x 32, top-4"):
        e2e_bench.e2e_bench(tmp_path / "work", 1.0, [0.25], 4, 1, ["ram"], "",
                            trace="warp:olmoe", shape="gpt-oss-tiny")


def test_the_default_warm_up_of_another_shape_leaves_the_learner_cold(tmp_path):
    """The default warm-up (gpt-oss-20b's train split) does not fit a store of another
    topology: the learner starts cold and the report says so; a --warmup of another shape is
    refused by name (a user's mistake, not a traceback)."""
    import argparse

    from flashmoe.errors import CheckpointError

    parser = argparse.ArgumentParser()
    e2e_bench.add_arguments(parser)
    args = parser.parse_args(["--shape", "qwen3-moe-1.7b", "--workdir", str(tmp_path)])
    warmup_dir, label = e2e_bench.choose_warmup(args, tmp_path)
    assert warmup_dir is None and label.startswith("none (cold") and "another shape" in label
    assert not (tmp_path / "warmup").exists()  # nothing made for a shape it does not fit
    ckpt = tmp_path / "gpt-oss-warmup"
    warmup(sequences_slice(load_gptoss20b("train"), "train-slice", 0, 1), load_config(env={}),
           ckpt, passes=0)
    args.warmup = str(ckpt)
    with pytest.raises(CheckpointError, match="qwen3-moe-1.7b shape"):
        e2e_bench.choose_warmup(args, tmp_path)
    args.shape = "gpt-oss-tiny"  # gpt-oss-20b's topology: it fits
    assert e2e_bench.choose_warmup(args, tmp_path) == (str(ckpt), None)
    assert e2e_bench.describe_warmup(str(ckpt)).startswith("train-slice, 0 pass(es)")


def test_precisions_each_get_a_row_with_their_mix_and_random_follows_dynamic(tmp_path):
    ckpt = tmp_path / "warmup"
    warmup(sequences_slice(load_gptoss20b("train"), "train-slice", 0, 2), load_config(env={}),
           ckpt, passes=1)
    said = []
    report = e2e_bench.e2e_bench(tmp_path / "work", 1.0, [0.25], 10, 1, ["flashmoe", "lru"],
                                 str(ckpt), shape="gpt-oss-tiny", say=said.append,
                                 precisions=("native", "int4", "dynamic", "random"))
    rows = {(r["mode"], r["precision"]): r for r in report["results"]}
    # lru skips what needs the learned estimate
    assert set(rows) == {("flashmoe", p) for p in ("native", "int4", "dynamic", "random")} \
        | {("lru", "native"), ("lru", "int4")}
    assert rows[("lru", "int4")]["precision_mix"] == {"int4": 1.0}
    assert rows[("flashmoe", "native")]["precision_mix"] == {"native": 1.0}
    for key in (("flashmoe", "dynamic"), ("flashmoe", "random")):
        mix = rows[key]["precision_mix"]
        assert set(mix) <= {"native", "int8", "int4"} and abs(sum(mix.values()) - 1) < 0.01
        assert rows[key]["bytes_read"] > 0
    runs = [line.split(":")[0].split()[-1] for line in said if "round" in line]
    assert runs.index("flashmoe-random") == runs.index("flashmoe-dynamic") + 1
    # the store got its copies on first use, and int4 reads fewer bytes than native
    assert any("copies" in line for line in said)
    assert rows[("lru", "int4")]["bytes_read"] < rows[("lru", "native")]["bytes_read"]
    assert "precision" in e2e_bench.format_table(report)
