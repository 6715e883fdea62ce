"""`flashmoe warmup --store STORE --text FILE`: the store's model reads local text through a
real cache manager, its routing is recorded and the learned policy pre-trained on it."""

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from common.config import load_config
from common.model_families import family_for_config
from common.traces import load_trace
from flashmoe.cli import main
from flashmoe.sim.learning import Learning
from flashmoe.tools.text_warmup import text_sequences
from services.inference_worker.generate import load_tokenizer

TEXT = ("The cache keeps the experts a model uses most. Experts live on the SSD.\n\n"
        "A second paragraph: the router picks two experts of eight in every layer, token by "
        "token, and the predictor learns which come next.\n\n"
        "Short.")


def test_text_warmup_records_the_models_own_routing(tiny_store, tiny_checkpoints, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    out = tmp_path / "ckpt"
    assert main(["warmup", "--store", str(tiny_store), "--text", str(text), "--out", str(out),
                 "--passes", "1"]) == 0
    trace = load_trace(str(out / "text_trace.npz"))
    sequences = text_sequences(TEXT, load_tokenizer(tiny_store))
    assert trace.n_sequences == len(sequences)
    assert trace.n_tokens == sum(len(s) - 1 for s in sequences)
    # The routing is the model's: transformers' own forward (eager experts), stepped as the
    # recording steps (the first token, then one token at a time on the KV cache), picks the
    # same experts at every step. (A single forward over the whole sequence runs other
    # matrix shapes and can break a near-tie differently.)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoints["qwen3_moe"]),
                                                 experts_implementation="eager")
    routed: dict[int, list] = {}
    routers = family_for_config(model.config.to_dict()).routers(model)
    hooks = [module.register_forward_hook(
        lambda mod, args, output, layer=layer: routed.setdefault(layer, []).append(  # indices
            next(t for t in output if not t.is_floating_point())))
        for layer, module in routers]
    try:
        with torch.inference_mode():
            past = model(torch.tensor([sequences[0][:1]]), use_cache=True).past_key_values
            for token in sequences[0][1:]:
                past = model(torch.tensor([[token]]), past_key_values=past,
                             use_cache=True).past_key_values
    finally:
        for h in hooks:
            h.remove()
    first = trace.experts[:len(sequences[0]) - 1]  # steps 1.. of sequence 0
    for i, (layer, _) in enumerate(routers):
        top = torch.cat([t.reshape(1, -1) for t in routed[layer][1:]]).numpy()
        assert np.array_equal(np.sort(first[:, i], -1), np.sort(top, -1)), layer
    learning = Learning.create(trace.num_layers, trace.num_experts, trace.top_k,
                               load_config(env={}))
    assert learning.load(out)["steps"] >= 0


def test_text_warmup_needs_a_store(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    assert main(["warmup", "--text", str(text), "--out", str(tmp_path / "x")]) == 2
    assert "--store" in capsys.readouterr().err
