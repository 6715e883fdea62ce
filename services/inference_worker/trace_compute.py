"""Real expert compute for the trace-driven worker.

The routing comes from a recorded trace, the weights from the store (a real model's, or random
ones of its shape: `flashmoe synth-store`), and each layer's experts run through transformers'
own eager experts code (the store family's experts module, built on the meta device; weights
fetched from the arena as zero-copy views, exactly as ``ModelRunner`` does). The hidden state is
a random vector per token carried through the layers (added and RMS-normalised after each),
so the compute of a decode step's experts is real while the routing stays the trace's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.model_families import family_for_config

from .model_runner import ArenaExperts, Fetch, ForwardContext, ModelLoadError, StepGroup


class TraceExperts:
    """The experts modules of the store's model; ``step`` runs one layer for one token."""

    def __init__(self, store_path: str | Path, fetch: Fetch, seed: int = 0) -> None:
        import json

        from transformers import AutoConfig, AutoModelForCausalLM

        store_path = Path(store_path)
        self.family = family_for_config(json.loads((store_path / "config.json").read_text()))
        config = AutoConfig.from_pretrained(str(store_path))
        # The weights' own dtype (bf16): a decode step is one token, a matrix-vector product
        # per projection, which torch runs as fast in bf16 as in float32 on this CPU, while
        # widening every expert's weights to float32 first would cost three times the product.
        self.dtype = torch.bfloat16
        self.top_k = int(getattr(config, self.family.top_k_key))
        self.hidden = int(config.hidden_size)
        self.fetch = fetch
        self.token = ""
        self._last_layer: int | None = None
        self._context: ForwardContext | None = None
        self.routed_around: dict[int, frozenset[int]] = {}  # a trace's routing is never changed
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=self.dtype,
                                                     experts_implementation="eager")
        self.experts: dict[int, ArenaExperts] = {}

        def make(layer, module):
            self.experts[layer] = ArenaExperts(layer, module, self.family, self)
            return self.experts[layer]

        if not self.family.swap_experts(model, make):
            raise ModelLoadError(f"{store_path}: no experts modules in the {self.family.name} "
                                 f"model")
        self.generator = torch.Generator().manual_seed(seed)

    # --- what ArenaExperts asks of its runner -----------------------------------------------

    def context(self) -> ForwardContext:
        return self._context

    def look_ahead(self, layer: int, hidden_states: torch.Tensor) -> dict:
        """The routing is the trace's: no router to look ahead with."""
        return {}

    def fetch_layer(self, layer: int, experts: list[int]) -> list[dict[str, torch.Tensor]]:
        release = [] if self._last_layer in (None, layer) else [self._last_layer]
        params = self.fetch(layer, experts, release, self.token)
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
             weights: list[float]) -> torch.Tensor:
        """One MoE layer: its experts (one AcquireReq) applied to ``hidden``."""
        index = torch.tensor([experts], dtype=torch.long)
        gate = torch.tensor([weights], dtype=self.dtype)
        # One forward alone: one request of the layer's experts, in the trace's order.
        group = StepGroup(1, self.fetch_layer, self.top_k, self.dtype)
        self._context = ForwardContext(group, self.token)
        with group.cond:
            out = hidden + self.experts[layer](hidden, index, gate)
        return (out.float() * torch.rsqrt(out.float().pow(2).mean(-1, keepdim=True) + 1e-6)
                ).to(self.dtype)
