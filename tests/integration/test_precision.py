"""Experts at a lower precision, end to end: a store's int8 and int4 copies (written,
verified, refused when stale), a real cache-manager process serving them, and the worker
computing with them what transformers computes with the same dequantized weights.

Per family, a tiny float32 model (transformers' own classes) is converted with its copies and
served at ``cache.precision`` int8 and int4 by an arena far smaller than the model. The
reference is the checkpoint in RAM through transformers' eager experts, each expert's weight
matrices replaced by ``dequantize(quantize(w))`` (common/quant.py): the worker's kernels
(services/inference_worker/quantized.py) must give the same logits to float32 rounding
(they sum in another order), teacher-forced on the reference's tokens.
"""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common import quant
from common.cache_client import CacheClient
from common.model_families import FAMILIES
from flashmoe.tools.convert import convert_checkpoint
from flashmoe.tools.store_writer import write_copies
from flashmoe.tools.synth_store import synth_store
from flashmoe.tools.tiny_models import build_tiny_model
from services.inference_worker.generate import arena_fetch
from services.inference_worker.model_runner import ModelRunner
from services.inference_worker.quantized import QWeight
from tests.support.stores import TEST_BLOCK_SIZE, TEST_PARALLELISM

LAYERS, EXPERTS, TOP_K = 2, 16, 4
STEPS = 6
PROMPT = "FlashMoE keeps the experts it expects to need soon at full precision."


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    made = {}

    def get(family: str):
        if family not in made:
            ckpt = build_tiny_model(family, root / family / "hf", dtype="float32",
                                    layers=LAYERS, experts=EXPERTS, top_k=TOP_K, hidden=64,
                                    expert_intermediate=48)
            store = root / family / "store"
            convert_checkpoint(ckpt, store, block_size=TEST_BLOCK_SIZE,
                               parallelism=TEST_PARALLELISM, show_progress=False)
            write_copies(store, ["int8", "int4"], show_progress=False)
            made[family] = (ckpt, store)
        return made[family]

    return get


def reference_logits(ckpt, family, precision, steps_ids):
    """transformers' eager forward with every expert's weight matrices dequantized from
    their ``precision`` copy: the last position's logits of the prompt, then of each id."""
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32,
                                                 experts_implementation="eager")
    transposed = FAMILIES[family].weights_in_out
    with torch.no_grad():
        for _, module in FAMILIES[family].experts_modules(model):
            for name, param in module.named_parameters(recurse=False):
                if param.ndim != 3:
                    continue  # biases stay
                for e in range(param.shape[0]):
                    q, scale = quant.quantize(precision, param[e].float(), transposed)
                    param.data[e] = quant.dequantize(precision, q, scale, param[e].shape,
                                                     transposed)
    out, cache = [], None
    with torch.inference_mode():
        for ids in steps_ids:
            step = model(input_ids=torch.tensor([ids]), use_cache=True, cache=cache)
            cache = step.cache if hasattr(step, "cache") else step.past_key_values
            out.append(step.logits[0, -1].clone())
    return out


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_worker_at_a_copy_computes_what_transformers_computes_with_its_weights(
        family, precision, stores, start_manager):
    ckpt, store = stores(family)
    prompt = AutoTokenizer.from_pretrained(str(store))(PROMPT)["input_ids"]
    # a budget of fewer slots than the experts the steps touch, whatever they route to: the
    # copies' slots are reused
    capacity = {"int8": 6, "int4": 4}[precision]
    manager = start_manager(store, f"cache.capacity_experts={capacity}",
                            f"cache.precision={precision}")
    with CacheClient(manager.endpoint) as client:
        assert {p.precision for p in client.arena.layout.pools} == {precision}
        fetch = arena_fetch(client)
        runner = ModelRunner(store, fetch)
        got = [runner.prefill(prompt)]
        assert set(fetch.precisions[0]) == {precision}
        ids = [prompt]
        for _ in range(STEPS):
            token = int(got[-1].logits.argmax())
            ids.append([token])
            got.append(runner.decode(token, f"<{token}>"))
        stats = client.stats()
    want = reference_logits(ckpt, family, precision, ids)
    for step, (mine, ref) in enumerate(zip(got, want)):
        scale = float(ref.abs().max())
        assert float((mine.logits.float() - ref).abs().max()) <= 1e-4 * scale, (family, step)
    assert stats["n_evict"] > 0 and stats[f"n_load_{precision}"] == stats["n_load"]
    assert stats["n_checksum_error"] == 0


def test_a_cache_manager_asked_for_a_copy_the_store_lacks_says_how_to_make_it(tmp_path,
                                                                             start_manager):
    path = tmp_path / "s"
    synth_store(path, "gpt-oss-tiny", 0.5, show_progress=False).close()
    manager = start_manager(path, "cache.precision=int4")
    assert manager.proc.wait(60) != 0
    assert "--precisions" in manager.log()


def test_dynamic_serves_three_pools_and_a_qweight_reads_the_arena_in_place(tmp_path,
                                                                          start_manager):
    path = tmp_path / "s"
    synth_store(path, "gpt-oss-tiny", 0.5, show_progress=False).close()
    write_copies(path, ["int8", "int4"], show_progress=False)
    manager = start_manager(path, "cache.capacity_experts=40", "cache.precision=random",
                            "cache.precision_split=0.2,0.3,0.5", "cache.precision_fractions=1,1,1")
    with CacheClient(manager.endpoint) as client:
        names = [p.precision for p in client.arena.layout.pools]
        assert names == ["native", "int8", "int4"]
        fetch = arena_fetch(client)
        seen = set()
        for layer in range(24):
            params = fetch(layer, [0, 1, 2, 3], [layer - 1] if layer else [], "")
            seen.update(fetch.precisions[layer])
            for p, precision in zip(params, fetch.precisions[layer]):
                w = p["gate_up_proj"]
                assert isinstance(w, QWeight) == (precision != "native")
                if isinstance(w, QWeight):
                    base = np.frombuffer(client.arena.mmap, dtype=np.uint8).ctypes.data
                    assert base <= w.q.data_ptr() < base + len(client.arena.mmap)
        # an expert still in its slot is given with the parameters made for it before
        again = fetch(23, [3, 2, 1, 0], [], "")
        assert all(a is b for a, b in zip(again, reversed(params)))
        stats = client.stats()
    assert seen == {"native", "int8", "int4"}
    assert sum(stats[f"n_load_{p}"] for p in names) == stats["n_load"] == 96
