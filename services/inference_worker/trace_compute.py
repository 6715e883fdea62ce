"""Real expert compute for the trace-driven worker.

The routing comes from a recorded trace, the weights from the store (a real model's, or random
ones of its shape: `flashmoe synth-store`), and each layer's chosen experts compute what
transformers' eager experts forward of the store's family computes for one position
(``experts_forward``), with the family's own gate from transformers' experts module (built on
the meta device: it holds no weights). The weights are the fetched zero-copy views; native bf16
ones are multiplied in place by ``fm_bf16_gemv`` (``quantized.bf16_products``), all of a
layer's experts in one call. The hidden state is a random vector per token carried through the
layers (added and RMS-normalised after each), so the compute of a decode step's experts is real
while the routing stays the trace's.

Why not transformers' eager forward itself, as ``ModelRunner`` runs it: for one position its
loop over the experts is overhead (a one-hot mask, a search and an index_add_ per expert, the
StepGroup meeting), and it multiplies one expert at a time through torch's bf16 product. At the
qwen3-moe-1.7b shape all in RAM a token takes ~28 ms this way, ~22 of them in the kernel; the
eager way takes ~106: ~68 in torch's products, ~18 in the loop's own steps, ~6 in the gate row
by row, ~9 making the weights' views, ~5 in the step around them.
``experts_forward`` does the eager forward's arithmetic in its order (the experts in ascending
id, the weighted rows added in the compute dtype one after another, as index_add_ does):
through torch's products it is bit-identical to the eager forward, through the kernel equal to
it but for a bf16 rounding of the products (tests/unit/test_native_kernel.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from common.model_families import family_for_config

from .model_runner import Fetch, ModelLoadError
from .quantized import bf16_products


class TraceExperts:
    """The experts modules of the store's model; ``step`` runs one layer for one token."""

    def __init__(self, store_path: str | Path, fetch: Fetch, seed: int = 0) -> None:
        import json

        from transformers import AutoConfig, AutoModelForCausalLM

        store_path = Path(store_path)
        self.family = family_for_config(json.loads((store_path / "config.json").read_text()))
        config = AutoConfig.from_pretrained(str(store_path))
        # The weights' own dtype (bf16): a decode step is one token, a matrix-vector product
        # per projection, bound by the weights' bytes, which widening every expert's weights
        # to float32 first would triple.
        self.dtype = torch.bfloat16
        self.top_k = int(getattr(config, self.family.top_k_key))
        self.hidden = int(config.hidden_size)
        self.fetch = fetch
        self.token = ""
        self._last_layer: int | None = None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype,
                                                     experts_implementation="eager")
        self.experts = dict(self.family.experts_modules(model))
        if not self.experts:
            raise ModelLoadError(f"{store_path}: no experts modules in the {self.family.name} "
                                 f"model")
        for layer, module in self.experts.items():
            check_experts_module(layer, module, self.family)
        self.generator = torch.Generator().manual_seed(seed)

    def fetch_layer(self, layer: int, experts: list[int], weights: Sequence[float] = ()
                    ) -> list[dict[str, torch.Tensor]]:
        """One request, dropping the pins of the layer fetched before; ``weights``: the
        router's weight of each expert, or none."""
        release = [] if self._last_layer in (None, layer) else [self._last_layer]
        params = self.fetch(layer, experts, release, self.token, weights)
        self._last_layer = layer
        return params

    def forget_pins(self) -> None:
        """The worker's pins were all released (a skipped token): no layer to drop next."""
        self._last_layer = None

    def rebind(self, fetch: Fetch) -> None:
        """Fetch through a new client (after a reconnection), which holds no pins yet."""
        self.fetch = fetch
        self.forget_pins()

    # --- the worker's step ------------------------------------------------------------------

    def new_token(self, token: str) -> torch.Tensor:
        """A fresh hidden state for the next decode step."""
        self.token = token
        return torch.randn(1, self.hidden, generator=self.generator).to(self.dtype)

    @torch.inference_mode()
    def step(self, hidden: torch.Tensor, layer: int, experts: list[int],
             weights: list[float], known_weights: bool = True) -> torch.Tensor:
        """One MoE layer: its experts (one AcquireReq, in the trace's order, with their
        router weights unless not ``known_weights``) applied to ``hidden``."""
        request: dict[int, float] = {}  # expert -> its weight (a repeated one's summed)
        for expert, weight in zip(experts, weights):
            request[expert] = request.get(expert, 0.0) + weight
        params = dict(zip(request, self.fetch_layer(
            layer, list(request), list(request.values()) if known_weights else ())))
        out = hidden + experts_forward(self.experts[layer], hidden, experts, weights, params,
                                       self.dtype)
        return torch.nn.functional.rms_norm(out.float(), (self.hidden,), eps=1e-6
                                            ).to(self.dtype)


def check_experts_module(layer: int, module: torch.nn.Module, family) -> None:
    """``experts_forward`` computes what this module's eager forward does: a transformers 5
    experts module (``use_experts_implementation``'s flags) of the family's parameters,
    without a norm after each expert."""
    names = {name for name, _ in module.named_parameters(recurse=False)}
    if names != set(family.memory_parameters) or not hasattr(module, "is_transposed") \
            or getattr(module, "has_post_expert_norm", False):
        raise ModelLoadError(
            f"layer {layer}: transformers' {type(module).__name__} has parameters "
            f"{sorted(names)} and flags {_flags(module)}; the trace worker computes experts "
            f"with the {family.name} adapter's {sorted(family.memory_parameters)} and no post "
            f"expert norm (an unsupported transformers version?)")


def _flags(module) -> dict:
    return {name: getattr(module, name, None)
            for name in ("is_transposed", "has_gate", "has_bias", "has_post_expert_norm")}


def experts_forward(module: torch.nn.Module, hidden: torch.Tensor, experts: list[int],
                    weights: list[float], params: dict[int, dict], dtype: torch.dtype
                    ) -> torch.Tensor:
    """transformers' eager forward of the experts ``module`` for one position ``hidden``
    ([1, H]) routed to ``experts`` with ``weights`` (rounded to ``dtype``, as the router's
    are), on ``params`` (expert -> its parameter slices: tensors or QWeights).

    The eager loop visits the experts in ascending id and adds their weighted rows in that
    order, in the compute dtype: so does this. Where every expert's weights are native bf16
    tensors, each projection of all of them is one kernel call and the gate one call on their
    rows together (~50 us a layer against ~270 row by row: the same elementwise arithmetic,
    but torch's vector loops may round the last bit of a row's tail differently); otherwise
    (a precision copy among them, or another dtype) each expert is computed alone, as the
    eager loop does."""
    order = sorted(range(len(experts)), key=experts.__getitem__)
    chosen = [params[experts[j]] for j in order]
    scale = torch.tensor([[weights[j]] for j in order], dtype=dtype)
    first = "gate_up_proj" if module.has_gate else "up_proj"
    rows = None
    if all(_native(p, hidden) for p in chosen):
        rows = _products(hidden, chosen, first, module)
        if rows is not None:
            rows = _products(_activation(module, rows), chosen, "down_proj", module)
    if rows is None:
        rows = torch.cat([_product(_activation(module, _product(hidden, p, first, module)), p,
                                   "down_proj", module) for p in chosen])
    total = torch.zeros_like(hidden)
    for row in (rows * scale).unbind():
        total += row
    return total


def _native(params: dict, x: torch.Tensor) -> bool:
    """Whether the kernel takes this expert: bf16 activations, bf16 tensors for weights."""
    return x.dtype is torch.bfloat16 and all(
        type(t) is torch.Tensor and t.dtype is torch.bfloat16 for t in params.values())


def _activation(module: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    return module._apply_gate(rows) if module.has_gate else module.act_fn(rows)


def _products(x: torch.Tensor, chosen: list[dict], name: str, module: torch.nn.Module
              ) -> torch.Tensor | None:
    """Every chosen expert's ``name`` projection (and bias) of ``x`` (one row for all, or
    one each) in one kernel call: [k, out], or None without the kernel."""
    biases = [p[name + "_bias"] for p in chosen] if module.has_bias else None
    return bf16_products(x, [p[name] for p in chosen], biases, module.is_transposed)


def _product(x: torch.Tensor, params: dict, name: str, module: torch.nn.Module
             ) -> torch.Tensor:
    """One expert's ``name`` projection (and bias) of ``x`` ([1, in]): the kernel's for
    native bf16 weights, else the eager code's own call (torch's product, or a QWeight's)."""
    if _native(params, x):
        y = _products(x, [params], name, module)
        if y is not None:
            return y
    weight = _as(params[name], x.dtype)
    y = x @ weight if module.is_transposed else torch.nn.functional.linear(x, weight)
    return y + _as(params[name + "_bias"], x.dtype) if module.has_bias else y


def _as(t, dtype: torch.dtype):
    """A store's tensor in the compute dtype (a precision copy's QWeight computes in its
    input's)."""
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype != dtype else t
