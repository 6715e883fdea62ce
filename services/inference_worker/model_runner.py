"""The inference worker's model core: a transformers MoE model whose experts live in the arena.

The model is transformers' own class for the store's ``config.json``, built on the meta
device; the non-expert weights are then loaded into RAM from the store's
``non_expert.safetensors``. Each MoE layer's experts module keeps its code but loses its
parameters (they are never materialised): ``ArenaExperts`` stands in for it and, once the
layer's router has chosen, fetches the chosen experts' weights with one request (one
AcquireReq to the cache manager, which also releases the layer acquired before it) and runs
transformers' eager experts forward on them, reading the weights straight from the arena's
zero-copy views. Running transformers' own eager code (``experts_implementation="eager"``),
with each expert's parameter slice bit-identical to the in-RAM model's, is what makes the
logits bit-identical to that model's.

A forward over many positions (the prompt's prefill) may route to more experts than the cache
holds; it then fetches them in ascending expert order (the order the eager loop visits them)
in requests of at most ``prefill_request_experts``, each replacing the layer's previous pins.

No sockets here: ``fetch(layer, experts, release_layers, token)`` returns each expert's
in-memory parameter slices (``generate.arena_fetch`` makes one from a ``CacheClient``).
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common.model_families import ModelFamily, family_for_config
from common.store import CONFIG_NAME, NON_EXPERT_NAME, StoreError

# fetch(layer, experts, release_layers, token) -> per expert, {parameter name: tensor}
Fetch = Callable[[int, list[int], Sequence[int], str], list[dict[str, torch.Tensor]]]


# safetensors (0.8) hands out tensors in place in the file's bytes, where a tensor starts
# wherever the one before it ended; a float32 product through MKL takes another path on a
# weight that is not 16-byte aligned and rounds differently in the last bits (seen on an AVX-512
# CPU). A non-expert weight that does not start on a 64-byte boundary (a cache line, the widest
# vector) is copied into an allocation of its own, whatever its dtype, so that the worker's
# products do not depend on where the converter happened to put a tensor.
WEIGHT_ALIGN = 64


class ModelLoadError(StoreError):
    """The store's model cannot be built or its weights do not fit transformers' model."""


@dataclass
class StepResult:
    """One forward pass, seen from its last position."""
    logits: torch.Tensor  # (vocab,) the last position's logits, in the model's dtype
    experts: list[list[int]]  # per MoE layer: the router's top-k at the last position
    probs: list[list[float]]  # the same shape: their routing weights
    token: str  # the step's input token as the caller named it ("" for a prefill)


class _ExpertBank:
    """Stands in for one fused expert parameter ([E, ...]) of an experts module: indexing it
    with an expert id gives that expert's slice, fetched through the layer's fetch plan."""

    def __init__(self, owner: ArenaExperts, parameter: str) -> None:
        self.owner, self.parameter = owner, parameter

    def __getitem__(self, expert) -> torch.Tensor:
        return self.owner.plan.parameters_of(int(expert))[self.parameter]


class _FetchPlan:
    """The experts one forward of one layer needs, fetched in order, one request at a time."""

    def __init__(self, runner: ModelRunner, layer: int, requests: list[list[int]]) -> None:
        self.runner, self.layer, self.requests = runner, layer, requests
        self.loaded: dict[int, dict[str, torch.Tensor]] = {}

    def next_request(self) -> None:
        # The views of the previous request go first: the next request unpins them.
        self.loaded = {}
        experts = self.requests.pop(0)
        params = self.runner.fetch_layer(self.layer, experts)
        dtype = self.runner.dtype
        self.loaded = {expert: {name: t if t.dtype == dtype else t.to(dtype)
                                for name, t in p.items()}
                       for expert, p in zip(experts, params)}

    def parameters_of(self, expert: int) -> dict[str, torch.Tensor]:
        while expert not in self.loaded:
            if not self.requests:
                raise RuntimeError(f"layer {self.layer}: the experts forward used expert "
                                   f"{expert} out of ascending order, or one the router did "
                                   f"not select")
            self.next_request()
        return self.loaded[expert]


class ArenaExperts(nn.Module):
    """A MoE layer's experts computed from fetched weights, by transformers' eager code."""

    def __init__(self, layer: int, experts: nn.Module, family: ModelFamily,
                 runner: ModelRunner) -> None:
        super().__init__()
        names = {name for name, _ in experts.named_parameters(recurse=False)}
        if names != set(family.memory_parameters):
            raise ModelLoadError(
                f"layer {layer}: transformers' {type(experts).__name__} has parameters "
                f"{sorted(names)}, the {family.name} adapter expects "
                f"{sorted(family.memory_parameters)} (an unsupported transformers version?)")
        for name in names:
            delattr(experts, name)  # meta tensors: nothing was ever allocated
            object.__setattr__(experts, name, _ExpertBank(self, name))
        self.layer = layer
        self.eager = experts
        self.runner = runner  # a plain reference (not a module)
        self.plan: _FetchPlan | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        runner = self.runner
        runner.record_routing(self.layer, top_k_index, top_k_weights)
        if top_k_index.shape[0] == 1:  # one position: the router's top-k, in its order
            requests = [top_k_index[0].tolist()]
        else:  # the eager loop's order: ascending expert ids
            chosen = sorted(set(top_k_index.flatten().tolist()))
            n = runner.prefill_request_experts
            requests = [chosen[i:i + n] for i in range(0, len(chosen), n)]
        self.plan = _FetchPlan(runner, self.layer, requests)
        try:
            self.plan.next_request()  # at once: the layer's routing is known
            return self.eager(hidden_states, top_k_index, top_k_weights)
        finally:
            self.plan = None  # no view of the arena outlives the layer's forward


def _dtype_of(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


class ModelRunner:
    """Greedy-decoding core of the worker: prefill a prompt, then one token per step, with a
    KV cache; every forward reports each MoE layer's routing of its last position."""

    def __init__(self, store_path: str | Path, fetch: Fetch, dtype: torch.dtype | None = None,
                 prefill_request_experts: int | None = None,
                 attn_implementation: str | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        store_path = Path(store_path)
        config_path = store_path / CONFIG_NAME
        try:
            raw_config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{config_path}: cannot read the model's config: {exc}") from None
        self.family = family_for_config(raw_config)
        config = AutoConfig.from_pretrained(str(store_path))
        self.dtype = dtype or _dtype_of(config)
        self.top_k = int(getattr(config, self.family.top_k_key))
        self.prefill_request_experts = max(prefill_request_experts or self.top_k, self.top_k)
        self.fetch = fetch
        kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype,
                                                     experts_implementation="eager", **kwargs)
        if model.config._experts_implementation != "eager":
            raise ModelLoadError(f"transformers did not select the eager experts "
                                 f"implementation (got {model.config._experts_implementation!r})")
        self.moe_layers = self.family.swap_experts(
            model, lambda layer, experts: ArenaExperts(layer, experts, self.family, self))
        if not self.moe_layers:
            raise ModelLoadError(f"{store_path}: transformers' {type(model).__name__} has no "
                                 f"experts modules where the {self.family.name} adapter looks")
        self._load_non_expert(model, store_path / NON_EXPERT_NAME)
        model.eval()
        self.model = model
        self.cache_name = ("cache" if "cache" in inspect.signature(model.forward).parameters
                           else "past_key_values")
        self.cache = None
        self.token = ""  # the current step's input token: the cache manager's context
        self._last_layer: int | None = None  # the layer whose pins the next request drops
        self._routing: dict[int, tuple[list[int], list[float]]] = {}

    def _load_non_expert(self, model: nn.Module, path: Path) -> None:
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot read the non-expert weights: {exc}") from None
        targets = dict(model.state_dict(keep_vars=True))
        state = {}
        for key, tensor in tensors.items():
            name = self.family.memory_key(key)
            if name not in targets:
                raise ModelLoadError(f"{path}: tensor {key} has no place in transformers' "
                                     f"{type(model).__name__} (as {name})")
            want = targets[name]
            if tuple(tensor.shape) != tuple(want.shape):
                raise ModelLoadError(f"{path}: tensor {key} is {list(tensor.shape)}, the model "
                                     f"wants {list(want.shape)}")
            if tensor.dtype != want.dtype:
                tensor = tensor.to(want.dtype)
            elif tensor.data_ptr() % WEIGHT_ALIGN:
                tensor = tensor.clone()
            state[name] = tensor
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()
        # Buffers not in checkpoints (rotary frequencies) are computed, as from_pretrained does.
        with torch.no_grad():
            for module in model.modules():
                meta = [name for name, b in module.named_buffers(recurse=False) if b.is_meta]
                if not meta:
                    continue
                for name in meta:  # NaN where it can be: a buffer left uncomputed shows
                    buffer = module._buffers[name]
                    module._buffers[name] = (torch.full_like(buffer, math.nan, device="cpu")
                                             if buffer.is_floating_point() else
                                             torch.zeros_like(buffer, device="cpu"))
                model._init_weights(module)
                unset = [name for name in meta if module._buffers[name].is_floating_point()
                         and module._buffers[name].isnan().any()]
                if unset:
                    raise ModelLoadError(f"transformers left {type(module).__name__} buffers "
                                         f"{unset} uncomputed")
        left = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
                if t.is_meta]
        if left:
            raise ModelLoadError(f"{path}: no weights for {left[:5]}"
                                 f"{' ...' if len(left) > 5 else ''}")

    @property
    def eos_token_ids(self) -> set[int]:
        eos = self.model.config.eos_token_id
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    # --- called by ArenaExperts -----------------------------------------------------------

    def record_routing(self, layer: int, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> None:
        self._routing[layer] = (top_k_index[-1].tolist(), top_k_weights[-1].float().tolist())

    def fetch_layer(self, layer: int, experts: list[int]) -> list[dict[str, torch.Tensor]]:
        release = [] if self._last_layer in (None, layer) else [self._last_layer]
        params = self.fetch(layer, experts, release, self.token)
        self._last_layer = layer
        return params

    # --- decoding -------------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new sequence (drops the KV cache)."""
        self.cache = None

    def forward(self, ids: list[int], token: str = "") -> StepResult:
        """Run ``ids`` after what the KV cache holds; ``token`` is the step's input token as
        text (context sent with each acquire)."""
        self.token = token
        self._routing = {}
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), use_cache=True,
                             **{self.cache_name: self.cache})
        self.cache = getattr(out, self.cache_name)
        rows = [self._routing[layer] for layer in self.moe_layers]
        return StepResult(out.logits[0, -1], [r[0] for r in rows], [r[1] for r in rows], token)

    def prefill(self, ids: list[int]) -> StepResult:
        """A new sequence: its prompt in one forward pass."""
        self.reset()
        return self.forward(ids)

    def decode(self, token: int, token_text: str = "") -> StepResult:
        """One decode step: feed the previous step's token."""
        return self.forward([token], token_text)
