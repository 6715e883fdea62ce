"""Trace loaders (those marked `traces` skip when the shared traces are absent) and the trace
file."""

import json

import numpy as np
import pytest

from common.traces import Trace, TraceError, load_trace, load_trace_file, save_trace


@pytest.mark.traces
def test_gptoss_eval_split_matches_the_readme():
    trace = load_trace("gptoss20b:eval")
    assert trace.n_sequences == 218 and trace.n_tokens == 79265
    assert trace.experts.shape[1:] == (24, 4) and trace.num_experts == 32
    assert trace.n_requests == 79265 * 96  # 7.6 M accesses
    assert all(not s.get("has_repetition") for s in trace.sequences)
    assert {s["dataset"] for s in trace.sequences} <= {
        "mmlu_test", "mmlu_pro_test", "mmlu_pro_validation", "gpqa_diamond", "gpqa_extended",
        "Polyglot-or-Not_Fact-Completion", "tulu3_persona_if"}


@pytest.mark.traces
def test_gptoss_train_split_and_repetition_filter():
    train, everything = load_trace("gptoss20b:train"), load_trace("gptoss20b:all")
    assert train.n_sequences + 218 == everything.n_sequences == 494
    assert {s["dataset"] for s in train.sequences} <= {"mmlu_dev", "mmlu_validation",
                                                        "gpqa_main", "sorry_bench_base"}
    assert np.all(np.diff(train.offsets) == [s["n_decode_tokens"] for s in train.sequences])


@pytest.mark.traces
@pytest.mark.parametrize("which, shape", [("olmoe", (299, 16, 8)), ("kimi", (300, 26, 8))])
def test_warp_traces(which, shape):
    trace = load_trace(f"warp:{which}")
    assert trace.experts.shape == shape and trace.n_sequences == 1


def test_trace_file_roundtrip_and_errors(tmp_path):
    experts = np.random.default_rng(0).integers(0, 8, size=(7, 3, 2), dtype=np.int16)
    trace = Trace("t", experts, np.array([0, 3, 7]), 8, "tiny", experts.astype(np.float16),
                  [{"a": 1}, {"a": 2}])
    save_trace(trace, tmp_path / "t.npz", model_type="olmoe", moe_layers=[0, 1, 2])
    back = load_trace(str(tmp_path / "t.npz"))
    assert np.array_equal(back.experts, experts) and back.sequences == [{"a": 1}, {"a": 2}]
    assert back.num_experts == 8 and back.probs is not None
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceError, match="not a FlashMoE trace file"):
        load_trace_file(tmp_path / "bad.npz")
    np.savez(tmp_path / "v9.npz", experts=experts, offsets=np.array([0, 7]),
             meta=np.array(json.dumps({"format": "flashmoe-trace", "version": 9})))
    with pytest.raises(TraceError, match="version 9"):
        load_trace_file(tmp_path / "v9.npz")
    with pytest.raises(TraceError, match="unknown trace"):
        load_trace("nope:x")
    with pytest.raises(TraceError, match="offsets"):
        Trace("t", experts, np.array([0, 5]), 8, "m")
    with pytest.raises(TraceError, match="expert ids"):
        Trace("t", experts, np.array([0, 7]), 4, "m")


def test_missing_shared_traces_are_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="not found"):
        load_trace("gptoss20b:eval", tmp_path)
    with pytest.raises(TraceError, match="split"):
        load_trace("gptoss20b:valid", tmp_path)
    with pytest.raises(TraceError, match="not found"):  # fit and dev are splits now
        load_trace("gptoss20b:dev", tmp_path)
