"""`flashmoe trace record` on tiny random models of each family (real transformers classes).

The recorded decode-step routing (KV-cached, one token per step) must equal the routing that
one full forward pass over prompt + generated tokens computes at the same positions."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.traces import load_trace
from flashmoe.cli import main as cli
from flashmoe.tools.tiny_models import build_tiny_model

FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "gpt_oss")


@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_routing_matches_a_full_forward(family, tmp_path):
    model_dir = build_tiny_model(family, tmp_path / "model", dtype="float32", layers=3,
                                 experts=8, top_k=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in [
        {"input_ids": [5, 17, 42, 9], "tag": "a"}, {"input_ids": [3, 8]}]) + "\n")
    out = tmp_path / "trace.npz"
    assert cli(["trace", "record", "--model", str(model_dir), "--prompts", str(prompts),
                "--out", str(out), "--max-new-tokens", "12"]) == 0
    trace = load_trace(str(out))
    assert trace.num_layers == 3 and trace.top_k == 2 and trace.num_experts == 8
    assert trace.n_sequences == 2 and trace.sequences[0]["tag"] == "a"
    assert np.all(trace.probs > 0) and np.all(np.diff(trace.probs.astype(np.float32), axis=-1) <= 0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    for s, prompt in enumerate([[5, 17, 42, 9], [3, 8]]):
        rows = trace.experts[trace.offsets[s]:trace.offsets[s + 1]]
        generated = trace.sequences[s]["generated_ids"]
        assert len(generated) == len(rows) + 1 and len(rows) >= 1
        ids = torch.tensor([prompt + generated[:len(rows)]])
        with torch.inference_mode():
            logits = model(ids, output_router_logits=True).router_logits
        for layer in range(3):
            positions = logits[layer].reshape(ids.shape[1], -1)[len(prompt):]
            top = torch.topk(torch.softmax(positions.float(), -1), 2).indices.numpy()
            assert np.array_equal(top, rows[:, layer, :]), (family, s, layer)


def test_bad_prompts_and_models_are_clear_errors(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"neither": 1}\n')
    assert cli(["trace", "record", "--model", str(tmp_path), "--prompts", str(prompts),
                "--out", str(tmp_path / "t.npz")]) == 2
    assert "no config.json" in capsys.readouterr().err
