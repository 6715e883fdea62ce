"""Model-family adapters: where a Hugging Face MoE checkpoint keeps its experts.

Checkpoints on disk store one tensor per expert projection (transformers fuses them only in
memory), so an adapter is a key pattern plus the canonical projection order that the store
uses inside each expert's bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """The checkpoint is not a model family FlashMoE knows how to convert."""


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]  # config.json "model_type" values of this family
    expert_key: re.Pattern  # groups: layer, expert, projection
    projections: tuple[str, ...]  # order of the projections inside an expert's bytes
    num_experts_key: str
    top_k_key: str = "num_experts_per_tok"

    def parse_key(self, key: str) -> tuple[int, int, str] | None:
        match = self.expert_key.fullmatch(key)
        if match is None:
            return None
        return int(match.group(1)), int(match.group(2)), match.group(3)


_LLAMA_STYLE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")

FAMILIES: dict[str, ModelFamily] = {
    "qwen3_moe": ModelFamily("qwen3_moe", ("qwen3_moe",), _LLAMA_STYLE,
                             ("gate_proj", "up_proj", "down_proj"), "num_experts"),
    "olmoe": ModelFamily("olmoe", ("olmoe",), _LLAMA_STYLE,
                         ("gate_proj", "up_proj", "down_proj"), "num_experts"),
    "mixtral": ModelFamily(
        "mixtral", ("mixtral",),
        re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight"),
        ("w1", "w3", "w2"), "num_local_experts"),
}


def family_for_config(config: dict) -> ModelFamily:
    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    known = ", ".join(t for f in FAMILIES.values() for t in f.model_types)
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not a supported MoE family (supported: {known})")


# GPT-OSS keeps a layer's experts fused on disk (``mlp.experts.gate_up_proj`` [E, H, 2I] and
# ``down_proj`` [E, I, H], each with a bias); FlashMoE stores them per expert, in this order.
GPT_OSS_PROJECTIONS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def gpt_oss_expert_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """Per-expert tensor shapes of a GPT-OSS model (transformers' layout)."""
    return {"gate_up_proj": (hidden, 2 * intermediate), "gate_up_proj_bias": (2 * intermediate,),
            "down_proj": (intermediate, hidden), "down_proj_bias": (hidden,)}
