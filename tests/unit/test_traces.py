"""Trace loaders (those marked `traces` skip when the shared traces are absent) and the trace
file."""

import json

import numpy as np
import pytest

from common.traces import (DEFAULT_TRACES_DIR, SAMPLE_DIR, SAMPLE_EVAL_TOKENS, SAMPLE_TRAIN_TOKENS,
                           Trace, TraceError, find_traces_dir, first_sequences, has_full_traces,
                           load_trace, load_trace_file, save_trace)


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


def test_a_token_stream_ends_a_sequence_only_at_its_last_step():
    """Steps whose text a trace lacks carry UNKNOWN_TOKEN, not "" (which ends a sequence: the
    feature extractor makes nothing for the step after it)."""
    from common.traces import UNKNOWN_TOKEN, TokenStream

    experts = np.zeros((5, 2, 1), dtype=np.int16)
    trace = Trace("t", experts, np.array([0, 3, 5]), 4, "m", None,
                  [{"generated_only": ["a", "b"]}])  # text for two steps of the first only
    stream = TokenStream.of(trace)
    assert stream.input_token == ["a", "b", UNKNOWN_TOKEN, UNKNOWN_TOKEN, UNKNOWN_TOKEN]
    assert stream.next_token == ["b", UNKNOWN_TOKEN, "", UNKNOWN_TOKEN, ""]
    assert stream.position.tolist() == [0, 1, 2, 0, 1]


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


def test_missing_full_traces_are_refused_never_replaced_by_the_sample(tmp_path):
    for split in ("eval", "dev", "train"):
        with pytest.raises(TraceError, match=r"--traces-dir.*gptoss20b-sample:train\|eval"):
            load_trace(f"gptoss20b:{split}", tmp_path)
    with pytest.raises(TraceError, match="split"):
        load_trace("gptoss20b:valid", tmp_path)
    with pytest.raises(TraceError, match="warp trace not found"):
        load_trace("warp:olmoe", tmp_path)


def test_the_traces_folder_is_the_flag_then_the_setting_then_the_default(tmp_path):
    assert find_traces_dir(tmp_path / "a", tmp_path / "b") == tmp_path / "a"
    assert find_traces_dir(None, str(tmp_path / "b")) == tmp_path / "b"
    assert find_traces_dir(None, "") == DEFAULT_TRACES_DIR
    assert not has_full_traces(tmp_path)


def test_the_committed_sample_is_its_own_trace():
    train, sample = load_trace("gptoss20b-sample:train"), load_trace("gptoss20b-sample:eval")
    assert (train.name, sample.name) == ("gptoss20b-sample:train", "gptoss20b-sample:eval")
    assert train.n_tokens <= SAMPLE_TRAIN_TOKENS and sample.n_tokens >= SAMPLE_EVAL_TOKENS
    for trace in (train, sample):
        assert trace.experts.shape[1:] == (24, 4) and trace.num_experts == 32
        assert trace.probs is not None and trace.model == "gpt-oss-20b"
        assert len(trace.sequences) == trace.n_sequences
        assert all(len(s["generated_only"]) >= s["n_decode_tokens"] for s in trace.sequences)
    assert sum(p.stat().st_size for p in SAMPLE_DIR.iterdir()) <= 5 * 2**20
    assert (SAMPLE_DIR / "LICENSE").is_file() and (SAMPLE_DIR / "README.md").is_file()
    with pytest.raises(TraceError, match="choose train, eval"):
        load_trace("gptoss20b-sample:dev")


@pytest.mark.traces
def test_the_sample_is_the_head_of_the_full_splits():
    for split, tokens, cover in (("train", SAMPLE_TRAIN_TOKENS, False),
                                 ("eval", SAMPLE_EVAL_TOKENS, True)):
        head = first_sequences(load_trace(f"gptoss20b:{split}"), tokens, cover=cover)
        sample = load_trace(f"gptoss20b-sample:{split}")
        assert np.array_equal(sample.experts, head.experts)
        assert np.array_equal(sample.offsets, head.offsets)
        assert np.array_equal(sample.probs, head.probs)
        assert sample.sequences == head.sequences


def test_first_sequences_keeps_whole_sequences():
    trace = Trace("t", np.zeros((10, 1, 1), np.int16), np.array([0, 3, 7, 10]), 4, "m")
    assert first_sequences(trace, 8).n_tokens == 7
    assert first_sequences(trace, 8, cover=True).n_tokens == 10
    assert first_sequences(trace, 2).n_tokens == 3  # at least one sequence
    assert first_sequences(trace, 7, cover=True).n_tokens == 7
