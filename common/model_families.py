"""Model-family adapters: where a MoE model keeps its experts, on disk and in memory.

One adapter per family says
  - on disk (``flashmoe convert``): which checkpoint tensors are experts' and which expert,
    layer and projection each holds. Qwen3-MoE, OLMoE and Mixtral checkpoints store one tensor
    per expert projection; GPT-OSS stores a layer's experts fused, one tensor per projection
    with the expert as dimension 0, which the store splits into per-expert slices. The store
    keeps each expert's projections in ``projections`` order;
  - in memory (the inference worker, trace record): where transformers puts a layer's experts
    module and router, and how one expert's slice of each of the module's parameters is made
    from the store's projections. transformers 5 fuses the experts of every family in memory
    (``gate_up_proj`` [E, 2I, H] is gate and up stacked, ``down_proj`` [E, H, I]; GPT-OSS keeps
    its on-disk layout); ``memory_parameters`` names, per in-memory parameter, the projections
    whose rows it stacks;
  - which on-disk names of non-expert tensors transformers renames when it loads them
    (``non_expert_renames``);
  - which transformers classes build a model of the family (``transformers_classes``: tiny
    random-weight models for tests).

And the named model shapes every other part reads: ``MODEL_SHAPES`` (the device model's
bytes per expert and per layer, `flashmoe bench`) and ``SYNTH_SHAPES`` (`flashmoe
synth-store`'s random stores in a real model's shape).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from common.store import ExpertEntry


class UnsupportedModelError(ValueError):
    """The checkpoint is not a model family FlashMoE knows how to convert."""


@dataclass(frozen=True)
class ExpertPart:
    """Where (part of) a checkpoint tensor goes in the store."""
    layer: int
    expert: int
    projection: str
    index: int | None  # None: the whole tensor; else its slice [index] along dimension 0


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]  # config.json "model_type" values of this family
    # On disk, per-expert families: groups layer, expert, projection. Fused families: groups
    # layer, projection; the tensor's dimension 0 is the expert.
    expert_key: re.Pattern
    projections: tuple[str, ...]  # order of the projections inside an expert's bytes
    num_experts_key: str
    # In memory: the parameters of a layer's experts module, each the rows of these store
    # projections stacked (dimension 0) for one expert.
    memory_parameters: dict[str, tuple[str, ...]] = field(hash=False)
    router_module: re.Pattern  # module names of the routers; group: layer
    experts_module: re.Pattern = re.compile(r"model\.layers\.(\d+)\.mlp\.experts")
    top_k_key: str = "num_experts_per_tok"
    fused_on_disk: bool = False
    # Checkpoint keys of expert tensors in a form the store cannot take, and why.
    unsupported_key: re.Pattern | None = None
    unsupported_why: str = ""
    # (pattern, replacement) applied in order to on-disk non-expert keys to give the in-memory
    # parameter names (transformers' own renames when it loads the checkpoint).
    non_expert_renames: tuple[tuple[str, str], ...] = field(default=())
    # transformers' config and model classes of the family (names in the transformers module).
    transformers_classes: tuple[str, str] = ("", "")
    # Whether the experts' weight matrices are [in, out] (``x @ W``, GPT-OSS) rather than
    # [out, in] (``F.linear``): a precision copy stores them as [out, in] (common/quant.py).
    weights_in_out: bool = False

    def parse_key(self, key: str) -> tuple[int, int, str] | None:
        """(layer, expert, projection) of a per-expert checkpoint key; None for any other key
        (and for every key of a fused family: see ``expert_parts``)."""
        if self.fused_on_disk:
            return None
        match = self.expert_key.fullmatch(key)
        if match is None:
            return None
        return int(match.group(1)), int(match.group(2)), match.group(3)

    def expert_parts(self, key: str, shape: tuple[int, ...]) -> list[ExpertPart] | None:
        """The store's pieces of one checkpoint tensor: one per expert it holds (a fused
        tensor holds ``shape[0]``); None for a non-expert tensor."""
        if self.unsupported_key is not None and self.unsupported_key.fullmatch(key):
            raise UnsupportedModelError(f"{key}: {self.unsupported_why}")
        match = self.expert_key.fullmatch(key)
        if match is None:
            return None
        if not self.fused_on_disk:
            return [ExpertPart(int(match.group(1)), int(match.group(2)), match.group(3), None)]
        if not shape:
            raise UnsupportedModelError(f"{key}: a fused expert tensor needs an expert dimension")
        layer, projection = int(match.group(1)), match.group(2)
        return [ExpertPart(layer, expert, projection, expert) for expert in range(shape[0])]

    @staticmethod
    def part_key(key: str, part: ExpertPart) -> str:
        """The name the manifest gives a piece: the checkpoint key, ``[expert]`` for a slice."""
        return key if part.index is None else f"{key}[{part.index}]"

    def memory_key(self, key: str) -> str:
        """In-memory name of an on-disk non-expert tensor."""
        for pattern, replacement in self.non_expert_renames:
            key = re.sub(pattern, replacement, key)
        return key

    def experts_modules(self, model) -> list[tuple[int, torch.nn.Module]]:
        """(layer, experts module) of every MoE layer of a transformers model, by layer."""
        return sorted(((int(m.group(1)), module) for name, module in model.named_modules()
                       if (m := self.experts_module.fullmatch(name))), key=lambda item: item[0])

    def swap_experts(self, model, make) -> list[int]:
        """Replace every MoE layer's experts module by ``make(layer, module)``; returns the
        layers, in order."""
        layers = []
        for layer, name in sorted((int(m.group(1)), name) for name, _ in model.named_modules()
                                  if (m := self.experts_module.fullmatch(name))):
            parent, _, child = name.rpartition(".")
            holder = model.get_submodule(parent)
            setattr(holder, child, make(layer, getattr(holder, child)))
            layers.append(layer)
        return layers

    def routers(self, model) -> list[tuple[int, torch.nn.Module]]:
        """(layer, router module) of every MoE layer of a transformers model, by layer."""
        return sorted(((int(m.group(1)), module) for name, module in model.named_modules()
                       if (m := self.router_module.fullmatch(name))), key=lambda item: item[0])

    def expert_parameters(self, entry: ExpertEntry, data, views: dict[str, torch.Tensor]
                          ) -> dict[str, torch.Tensor]:
        """One expert's slice of each in-memory parameter from its store bytes.

        ``data``: the expert's bytes (an arena slot); ``views``: its projections as tensors
        (``Arena.torch_views``). A parameter made of one projection is that view; one that
        stacks several is a view of ``data`` when they lie back to back there (the store's
        alignment keeps them so for any real model), else a stacked copy."""
        import warnings

        import torch

        out = {}
        tensors = {t.name: t for t in entry.tensors}
        for parameter, parts in self.memory_parameters.items():
            if len(parts) == 1:
                out[parameter] = views[parts[0]]
                continue
            first, pieces = tensors[parts[0]], [views[p] for p in parts]
            adjacent = all(tensors[b].offset == tensors[a].offset + tensors[a].nbytes
                           and tensors[b].dtype == first.dtype
                           and tensors[b].shape[1:] == first.shape[1:]
                           for a, b in pairwise(parts))
            if adjacent:
                rows = sum(tensors[p].shape[0] for p in parts)
                count = rows * (pieces[0].numel() // first.shape[0])
                with warnings.catch_warnings():
                    # An arena is mapped read-only in a worker, on purpose; torch warns.
                    warnings.simplefilter("ignore", UserWarning)
                    view = torch.frombuffer(data, dtype=pieces[0].dtype, count=count,
                                            offset=first.offset)
                out[parameter] = view.view(rows, *first.shape[1:])
            else:
                out[parameter] = torch.cat(pieces, dim=0)
        return out


_LLAMA_STYLE = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_GATE_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate")

# GPT-OSS keeps a layer's experts fused on disk (``mlp.experts.gate_up_proj`` [E, H, 2I] and
# ``down_proj`` [E, I, H], each with a bias); FlashMoE stores them per expert, in this order.
GPT_OSS_PROJECTIONS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def gpt_oss_expert_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    """Per-expert tensor shapes of a GPT-OSS model (transformers' layout)."""
    return {"gate_up_proj": (hidden, 2 * intermediate), "gate_up_proj_bias": (2 * intermediate,),
            "down_proj": (intermediate, hidden), "down_proj_bias": (hidden,)}


FAMILIES: dict[str, ModelFamily] = {
    "qwen3_moe": ModelFamily(
        "qwen3_moe", ("qwen3_moe",), _LLAMA_STYLE, ("gate_proj", "up_proj", "down_proj"),
        "num_experts", {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
        _GATE_ROUTER, transformers_classes=("Qwen3MoeConfig", "Qwen3MoeForCausalLM")),
    "olmoe": ModelFamily(
        "olmoe", ("olmoe",), _LLAMA_STYLE, ("gate_proj", "up_proj", "down_proj"),
        "num_experts", {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
        _GATE_ROUTER, transformers_classes=("OlmoeConfig", "OlmoeForCausalLM")),
    "mixtral": ModelFamily(
        "mixtral", ("mixtral",),
        re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight"),
        ("w1", "w3", "w2"), "num_local_experts",
        {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)},
        # transformers < 5 kept the on-disk name in memory too
        re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate"),
        non_expert_renames=((r"\.block_sparse_moe\.", ".mlp."),),
        transformers_classes=("MixtralConfig", "MixtralForCausalLM")),
    "gpt_oss": ModelFamily(
        "gpt_oss", ("gpt_oss",),
        re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(" + "|".join(GPT_OSS_PROJECTIONS)
                   + r")"),
        GPT_OSS_PROJECTIONS, "num_local_experts", {p: (p,) for p in GPT_OSS_PROJECTIONS},
        re.compile(r"model\.layers\.(\d+)\.mlp\.router"), fused_on_disk=True,
        unsupported_key=re.compile(r"model\.layers\.\d+\.mlp\.experts\.\w+_(?:blocks|scales)"),
        unsupported_why="MXFP4-quantized experts cannot be stored yet; dequantize the "
                        "checkpoint first (transformers: Mxfp4Config(dequantize=True), then "
                        "save_pretrained)",
        transformers_classes=("GptOssConfig", "GptOssForCausalLM"), weights_in_out=True),
}


def family_for_config(config: dict) -> ModelFamily:
    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    known = ", ".join(t for f in FAMILIES.values() for t in f.model_types)
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not a supported MoE family (supported: {known})")


# --- named model shapes -------------------------------------------------------------------------

@dataclass(frozen=True)
class SynthShape:
    """A model's expert layout as `flashmoe synth-store` writes it (GPT-OSS projections)."""
    name: str
    model_type: str
    hidden: int
    intermediate: int  # per expert, at scale 1
    layers: int
    experts: int
    top_k: int


@dataclass(frozen=True)
class ModelShape:
    """A model as the device model counts it: bytes read per miss and per layer."""
    name: str
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int  # one expert's weights in the checkpoint's own precision
    dense_bytes_per_layer: int  # attention + norms + router weights read per token per layer


GPT_OSS_20B = SynthShape("gpt-oss-20b", "gpt_oss", hidden=2880, intermediate=2880, layers=24,
                         experts=32, top_k=4)

SYNTH_SHAPES = {
    "gpt-oss-20b": GPT_OSS_20B,
    # gpt-oss-20b's layers, experts and top-k with tiny experts: tests and quick runs.
    "gpt-oss-tiny": replace(GPT_OSS_20B, name="gpt-oss-tiny", hidden=64, intermediate=64),
    # The mmap calibration's model: the 1.7 B Qwen3-MoE llama.cpp was measured on here (16
    # layers, 64 experts, top-8, hidden 1024, 3.3 GB f16 GGUF of which ~3.0 GB experts), in
    # the gpt-oss projection layout (a fused gate_up): the bytes per expert and per token and
    # the products per expert are that model's; routing from a trace of the same topology
    # (warp:olmoe, OLMoE's 16 x 64, top-8).
    "qwen3-moe-1.7b": SynthShape("qwen3-moe-1.7b", "gpt_oss", hidden=1024, intermediate=480,
                                 layers=16, experts=64, top_k=8),
}


def _mxfp4_bytes(n_weights: int) -> int:
    """MXFP4: 4 bits a weight plus one 8-bit scale per 32 weights (4.25 bits)."""
    return n_weights // 2 + n_weights // 32


def _gpt_oss_expert_bytes(shape: SynthShape) -> int:
    """gate_up and down in MXFP4, their biases in bf16."""
    sizes = {name: math.prod(dims) for name, dims in
             gpt_oss_expert_shapes(shape.hidden, shape.intermediate).items()}
    return (_mxfp4_bytes(sizes["gate_up_proj"] + sizes["down_proj"])
            + 2 * (sizes["gate_up_proj_bias"] + sizes["down_proj_bias"]))


# The device model's shapes. Expert bytes: one expert's weights in the checkpoint's precision
# (gpt-oss-20b: gate_up 2880x5760 + down 2880x2880 = 24.88 M weights in MXFP4 plus bf16
# biases; qwen3-30b-a3b: 3 x 2048 x 768 bf16; olmoe-1b-7b: 3 x 2048 x 1024 bf16). Dense bytes:
# a layer's attention projections (and router) in bf16.
MODEL_SHAPES = {
    "gpt-oss-20b": ModelShape("gpt-oss-20b", GPT_OSS_20B.layers, GPT_OSS_20B.experts,
                              GPT_OSS_20B.top_k, _gpt_oss_expert_bytes(GPT_OSS_20B),
                              2 * (2880 * 64 * 64 + 2 * 2880 * 8 * 64 + 64 * 64 * 2880)),
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 48, 128, 8, 2 * 3 * 2048 * 768,
                                2 * (2048 * 32 * 128 * 2 + 2 * 2048 * 4 * 128 + 2048 * 128)),
    "olmoe-1b-7b": ModelShape("olmoe-1b-7b", 16, 64, 8, 2 * 3 * 2048 * 1024,
                              2 * (4 * 2048 * 2048 + 2048 * 64)),
}
