"""Model-family adapters: checkpoint keys, transformers' in-memory modules, expert slices."""

import pytest
import torch

from common.model_families import (FAMILIES, GPT_OSS_PROJECTIONS, ExpertPart,
                                   UnsupportedModelError, family_for_config)
from common.store import ExpertEntry, TensorEntry
from flashmoe.tools.tiny_models import FAMILY_CLASSES, tiny_config


def test_every_family_has_a_tiny_model():
    assert set(FAMILY_CLASSES) == set(FAMILIES)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adapter_finds_transformers_experts_and_routers(family):
    """On a model built on the meta device (nothing allocated): one experts module and one
    router per layer, with exactly the parameters the adapter makes slices of."""
    from transformers import AutoModelForCausalLM

    adapter = FAMILIES[family]
    config = tiny_config(family, layers=3, experts=4, top_k=2)
    assert family_for_config(config.to_dict()) is adapter and hash(adapter)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = adapter.experts_modules(model)
    assert [layer for layer, _ in experts] == [0, 1, 2]
    assert [layer for layer, _ in adapter.routers(model)] == [0, 1, 2]
    for _, module in experts:
        params = dict(module.named_parameters(recurse=False))
        assert set(params) == set(adapter.memory_parameters)
        assert all(p.shape[0] == 4 for p in params.values())  # the expert dimension
    swapped = adapter.swap_experts(model, lambda layer, module: torch.nn.Identity())
    assert swapped == [0, 1, 2] and adapter.experts_modules(model)
    assert all(isinstance(m, torch.nn.Identity) for _, m in adapter.experts_modules(model))


def test_per_expert_keys():
    qwen = FAMILIES["qwen3_moe"]
    key = "model.layers.3.mlp.experts.17.up_proj.weight"
    assert qwen.parse_key(key) == (3, 17, "up_proj")
    assert qwen.expert_parts(key, (48, 64)) == [ExpertPart(3, 17, "up_proj", None)]
    assert qwen.part_key(key, qwen.expert_parts(key, (48, 64))[0]) == key
    assert qwen.expert_parts("model.layers.3.mlp.gate.weight", (8, 64)) is None
    mixtral = FAMILIES["mixtral"]
    assert mixtral.parse_key("model.layers.0.block_sparse_moe.experts.2.w3.weight") == (0, 2, "w3")


def test_gpt_oss_fused_keys_give_one_part_per_expert():
    gpt = FAMILIES["gpt_oss"]
    key = "model.layers.5.mlp.experts.gate_up_proj"
    parts = gpt.expert_parts(key, (4, 64, 96))
    assert parts == [ExpertPart(5, e, "gate_up_proj", e) for e in range(4)]
    assert gpt.part_key(key, parts[2]) == key + "[2]"  # synthetic stores name slices so too
    assert gpt.parse_key(key) is None  # the per-expert API does not apply to fused keys
    for name in GPT_OSS_PROJECTIONS:
        assert gpt.expert_parts(f"model.layers.0.mlp.experts.{name}", (2, 8)) is not None
    assert gpt.expert_parts("model.layers.0.mlp.router.weight", (4, 64)) is None
    with pytest.raises(UnsupportedModelError, match="MXFP4"):
        gpt.expert_parts("model.layers.0.mlp.experts.gate_up_proj_blocks", (4, 96, 2, 16))


def test_non_expert_renames():
    assert FAMILIES["mixtral"].memory_key("model.layers.1.block_sparse_moe.gate.weight") == \
        "model.layers.1.mlp.gate.weight"
    for family in ("qwen3_moe", "olmoe", "gpt_oss"):
        assert FAMILIES[family].memory_key("model.layers.1.mlp.gate.weight") == \
            "model.layers.1.mlp.gate.weight"


def test_unknown_model_type_is_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="llama"):
        family_for_config({"model_type": "llama"})


def _expert(gap: int) -> tuple[ExpertEntry, bytearray, dict]:
    """A Qwen-style expert (gate [3, 4], up [3, 4], down [4, 3] float32) in a byte buffer,
    ``gap`` bytes between gate and up; and its projection views."""
    values = {name: torch.arange(12, dtype=torch.float32).reshape(shape) + 100 * i
              for i, (name, shape) in enumerate([("gate_proj", (3, 4)), ("up_proj", (3, 4)),
                                                 ("down_proj", (4, 3))])}
    offsets = {"gate_proj": 0, "up_proj": 48 + gap, "down_proj": 96 + gap}
    data = bytearray(144 + gap)
    tensors = []
    for name, value in values.items():
        data[offsets[name]:offsets[name] + 48] = value.numpy().tobytes()
        tensors.append(TensorEntry(name, name, "F32", tuple(value.shape), offsets[name], 48))
    entry = ExpertEntry(0, 0, len(data), 0, 1, tuple(tensors))
    views = {name: torch.frombuffer(data, dtype=torch.float32, count=12,
                                    offset=offsets[name]).view(values[name].shape)
             for name in values}
    return entry, data, views


def test_stacked_parameter_is_a_view_of_the_store_bytes_when_adjacent():
    entry, data, views = _expert(gap=0)
    params = FAMILIES["qwen3_moe"].expert_parameters(entry, data, views)
    assert set(params) == {"gate_up_proj", "down_proj"}
    assert torch.equal(params["gate_up_proj"], torch.cat([views["gate_proj"], views["up_proj"]]))
    assert params["gate_up_proj"].data_ptr() == views["gate_proj"].data_ptr()  # no copy
    assert params["down_proj"] is views["down_proj"]


def test_stacked_parameter_is_a_copy_when_not_adjacent():
    entry, data, views = _expert(gap=16)
    params = FAMILIES["qwen3_moe"].expert_parameters(entry, data, views)
    assert torch.equal(params["gate_up_proj"], torch.cat([views["gate_proj"], views["up_proj"]]))
    assert params["gate_up_proj"].data_ptr() != views["gate_proj"].data_ptr()
