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

Forward passes run in a ``StepGroup``: one forward alone (``prefill``/``decode``, or the serving
engine's single sequence), or several sequences' forwards in threads that meet at every MoE
layer so that the union of their experts is fetched once (the serving engine's batch). A
forward over many positions (a prompt's prefill) may route to more experts than the cache
holds; the union is then fetched in ascending expert order (the order the eager loop visits
them) in requests of at most ``max_request`` experts, each replacing the layer's previous pins.

No sockets here: ``fetch(layer, experts, release_layers, token)`` returns each expert's
in-memory parameter slices (``generate.arena_fetch`` makes one from a ``CacheClient``).
"""

from __future__ import annotations

import inspect
import json
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from common.model_families import ModelFamily, family_for_config
from common.store import CONFIG_NAME, NON_EXPERT_NAME, StoreError

# fetch(layer, experts, release_layers, token, weights=()) -> per expert, {parameter name:
# tensor}; ``weights``: the router's weight of each expert (AcquireReq.weights), or none
Fetch = Callable[..., list[dict[str, torch.Tensor]]]


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
    # with ``all_positions``: per position, (experts, probs) of every MoE layer
    positions: list | None = None
    lookahead: dict = field(default_factory=dict)  # layer -> experts the look-ahead hinted
    rerouted: int = 0  # (position, layer) rows computed without an expert routed around


class _ExpertBank:
    """Stands in for one fused expert parameter ([E, ...]) of an experts module: indexing it
    with an expert id gives that expert's slice, from the layer's meeting of the calling
    thread's forward."""

    def __init__(self, owner: ArenaExperts, parameter: str) -> None:
        self.owner, self.parameter = owner, parameter

    def __getitem__(self, expert) -> torch.Tensor:
        ctx = self.owner.runner.context()
        return ctx.group.parameters(ctx.meet, int(expert))[self.parameter]


class _Meet:
    """One MoE layer of one step: the routing each forward brought, the union of their
    experts cut into requests, and the request whose weights are loaded now."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.rows: list[list[list[int]]] = []  # per forward: its positions' top-k
        self.weight: dict[int, float] = {}  # expert -> its router weights' sum over positions
        self.positions = 0
        self.requests: list[list[int]] = []
        self.done_requests = 0  # requests fetched so far
        self.loaded: dict[int, dict[str, torch.Tensor]] = {}
        self.waiting = 0  # forwards done with the loaded request, waiting for the next
        self.finished = 0  # forwards done with the layer


class StepGroup:
    """The forwards of one step, one thread each, meeting at every MoE layer: once all have
    brought their routing, the union of their experts is fetched in requests of at most
    ``max_request`` experts (ascending ids, the order the eager loop visits them; a single
    position's top-k in the router's order), and each forward computes its own experts from
    the shared weights. Each forward runs with ``cond`` held and lets go of it only while it
    waits, so one computes at a time: every product is the one it would be alone.

    ``fetch(layer, experts, weights)``: the weights of ``experts`` (one request to the cache
    manager, which drops the pins of the request before it; ``weights``: each expert's mean
    router weight over the step's positions). ``hint(layer, experts)``: a prefetch hint
    (router look-ahead), or None."""

    def __init__(self, size: int, fetch: Callable[[int, list[int], list[float]], list[dict]],
                 max_request: int, dtype: torch.dtype,
                 hint: Callable[[int, list[int]], None] | None = None) -> None:
        self.size, self.fetch, self.max_request, self.dtype = size, fetch, max_request, dtype
        self.hint = hint
        self.cond = threading.Condition()
        self.meets: dict[int, _Meet] = {}
        self.error: BaseException | None = None
        self.hints: dict[int, set[int]] = {}  # layer -> experts hinted for it this step

    def _wait(self, ready: Callable[[], bool]) -> None:
        while not ready():
            if self.error is not None:
                raise StepAborted(f"another forward of this step failed: {self.error!r}")
            self.cond.wait()
        if self.error is not None:
            raise StepAborted(f"another forward of this step failed: {self.error!r}")

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.cond.notify_all()

    def arrive(self, layer: int, rows: list[list[int]], lookahead: dict[int, set[int]],
               weights: list[list[float]] = ()) -> _Meet:
        """A forward's routing at ``layer``: its positions' top-k ``rows`` and their router
        ``weights``; it returns once the layer's first request is fetched."""
        meet = self.meets.get(layer)
        if meet is None:
            meet = self.meets[layer] = _Meet(layer)
        meet.rows.append(rows)
        meet.positions += len(rows)
        total = meet.weight
        for row, row_weights in zip(rows, weights):
            for expert, weight in zip(row, row_weights):
                total[expert] = total.get(expert, 0.0) + weight
        for ahead, experts in lookahead.items():
            self.hints.setdefault(ahead, set()).update(experts)
        if len(meet.rows) == self.size:
            if self.size == 1 and len(rows) == 1:
                meet.requests = [list(dict.fromkeys(rows[0]))]  # a rerouted row repeats one
            else:
                chosen = sorted({e for forward in meet.rows for row in forward for e in row})
                n = self.max_request
                meet.requests = [chosen[i:i + n] for i in range(0, len(chosen), n)]
            if self.hint is not None:
                for ahead, experts in self.hints.items():
                    if ahead not in self.meets:
                        self.hint(ahead, sorted(experts))
            self._next_request(meet)
        else:
            self._wait(lambda: meet.done_requests > 0)
        return meet

    def _next_request(self, meet: _Meet) -> None:
        meet.loaded = {}  # the views of the request before go first: this one unpins them
        meet.waiting = 0
        experts = meet.requests[meet.done_requests]
        n = meet.positions
        weights = [meet.weight.get(e, 0.0) / n for e in experts] if meet.weight else []
        try:
            params = self.fetch(meet.layer, experts, weights)
        except BaseException as exc:
            self.fail(exc)
            raise
        dtype = self.dtype
        # (a precision copy's weight is a QWeight, which computes in the input's dtype)
        meet.loaded = {expert: {name: t if t.dtype == dtype or not isinstance(t, torch.Tensor)
                                else t.to(dtype) for name, t in p.items()}
                       for expert, p in zip(experts, params)}
        meet.done_requests += 1
        self.cond.notify_all()

    def parameters(self, meet: _Meet, expert: int) -> dict[str, torch.Tensor]:
        while expert not in meet.loaded:
            if meet.done_requests >= len(meet.requests):
                raise RuntimeError(f"layer {meet.layer}: the experts forward used expert "
                                   f"{expert} out of ascending order, or one the router did "
                                   f"not select")
            generation = meet.done_requests
            meet.waiting += 1
            if meet.waiting + meet.finished == self.size:
                self._next_request(meet)
            else:
                self._wait(lambda: meet.done_requests != generation)
        return meet.loaded[expert]

    def leave(self, meet: _Meet) -> None:
        meet.finished += 1
        if self.error is not None:
            return
        if meet.finished == self.size:
            meet.loaded = {}
            del self.meets[meet.layer]
        elif meet.waiting and meet.waiting + meet.finished == self.size:
            self._next_request(meet)


class StepAborted(RuntimeError):
    """A forward of the step failed (a fetch, say): the others stop at their next meeting."""


@dataclass
class ForwardContext:
    """What one thread's forward keeps: its step group, its meeting, its routing."""
    group: StepGroup
    token: str = ""
    meet: _Meet | None = None
    # layer -> (top-k index, weights) tensors as computed (and fetched): the router's choice
    # but for experts routed around (see ModelRunner.reroute)
    routing: dict = field(default_factory=dict)
    chosen: dict = field(default_factory=dict)  # the same, as the router chose
    lookahead: dict = field(default_factory=dict)  # layer -> experts hinted for it
    rerouted: int = 0  # rows of this forward computed without an expert routed around


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

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        runner = self.runner
        ctx = runner.context()
        ctx.chosen[self.layer] = (top_k_index, top_k_weights)
        if self.layer in runner.routed_around:
            top_k_index, top_k_weights, rows = runner.reroute(self.layer, top_k_index,
                                                              top_k_weights)
            ctx.rerouted += rows
        ctx.routing[self.layer] = (top_k_index, top_k_weights)
        ahead = runner.look_ahead(self.layer, hidden_states)
        ctx.lookahead.update(ahead)
        ctx.meet = ctx.group.arrive(self.layer, top_k_index.tolist(), ahead,
                                    top_k_weights.tolist())
        try:
            return self.eager(hidden_states, top_k_index, top_k_weights)
        finally:
            meet, ctx.meet = ctx.meet, None  # no view of the arena outlives the layer
            ctx.group.leave(meet)


def _dtype_of(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


class ModelRunner:
    """The worker's model: forward passes of one or many sequences, each with its own KV
    cache; every forward reports each MoE layer's routing. ``forward`` runs one sequence in
    a ``StepGroup`` (the engine runs a step's sequences in threads of one group); ``prefill``
    and ``decode`` are the one-sequence form over the runner's own cache and ``fetch``."""

    def __init__(self, store_path: str | Path, fetch: Fetch | None = None,
                 dtype: torch.dtype | None = None,
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
        self.num_experts = int(getattr(config, self.family.num_experts_key))
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
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.cache_name = ("cache" if "cache" in inspect.signature(model.forward).parameters
                           else "past_key_values")
        # Router look-ahead: layer -> the next MoE layer's router (None: off).
        routers = dict(self.family.routers(model))
        self.next_router = {layer: routers.get(after) for layer, after
                            in zip(self.moe_layers, self.moe_layers[1:])}
        self.lookahead = False
        self._local = threading.local()
        self.cache = None  # the one-sequence form's KV cache
        self._last_layer: int | None = None  # the layer whose pins the next request drops
        # Experts whose blocks cannot be loaded (layer -> ids), computed without: see reroute.
        # Replaced whole (never changed in place) by the engine's thread between steps.
        self.routed_around: dict[int, frozenset[int]] = {}

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

    def context(self) -> ForwardContext:
        return self._local.ctx

    def look_ahead(self, layer: int, hidden_states: torch.Tensor) -> dict[int, set[int]]:
        """Router look-ahead: the next MoE layer's router applied to this layer's input (the
        residual stream it will see, but for this layer's own update); its top-k of the last
        position, {next layer: experts}, or {} when off."""
        router = self.next_router.get(layer) if self.lookahead else None
        if router is None:
            return {}
        with torch.inference_mode():
            index = router(hidden_states[-1:])[-1]
        after = self.moe_layers[self.moe_layers.index(layer) + 1]
        return {after: set(index[0].tolist()) - self.routed_around.get(after, frozenset())}

    def route_around(self, layer: int, experts: list[int]) -> None:
        """From now on compute ``layer`` without ``experts`` (their blocks cannot be loaded):
        ``reroute`` drops them from every top-k that chooses them."""
        self.routed_around = {**self.routed_around,
                              layer: self.routed_around.get(layer, frozenset()) | set(experts)}

    def may_route_around(self, layer: int, experts: list[int]) -> bool:
        """Whether ``layer`` keeps at least top-k usable experts without ``experts`` too."""
        gone = self.routed_around.get(layer, frozenset()) | set(experts)
        return self.num_experts - len(gone) >= self.top_k

    def reroute(self, layer: int, index: torch.Tensor, weights: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A top-k (``index``, ``weights``: positions x k) without the experts routed around
        at ``layer``, and the number of rows that chose one: such a row keeps its other
        experts, their weights scaled (in float32) to the row's total (they take the dropped
        expert's share), and the dropped place points at one of them with weight 0
        (transformers' eager loop adds it as nothing). A row whose every choice is routed
        around points at the layer's lowest usable expert with weight 0: its MoE output is
        zero, the residual carries the position on (``may_route_around`` keeps one)."""
        gone = self.routed_around[layer]
        dropped = torch.isin(index, torch.tensor(sorted(gone), dtype=index.dtype))
        rows = int(dropped.any(-1).sum())
        if not rows:
            return index, weights, 0
        keep = ~dropped
        w = weights.float()
        total = w.sum(-1, keepdim=True)
        kept = (w * keep).sum(-1, keepdim=True)
        scale = torch.where(kept > 0, total / torch.where(kept > 0, kept, 1.0), 0.0)
        new_weights = torch.where(keep, w * scale, 0.0).to(weights.dtype)
        usable = next(e for e in range(self.num_experts) if e not in gone)
        first_kept = index.gather(-1, keep.to(torch.int8).argmax(-1, keepdim=True))
        stand_in = torch.where(keep.any(-1, keepdim=True), first_kept,
                               torch.full_like(first_kept, usable))
        return torch.where(keep, index, stand_in), new_weights, rows

    def fetch_layer(self, layer: int, experts: list[int], token: str = "",
                    weights: Sequence[float] = ()) -> list[dict[str, torch.Tensor]]:
        """One request through ``fetch``, dropping the pins of the layer fetched before;
        ``weights``: the router's weight of each expert, or none."""
        release = [] if self._last_layer in (None, layer) else [self._last_layer]
        params = self.fetch(layer, experts, release, token, weights)
        self._last_layer = layer
        return params

    # --- forward passes -------------------------------------------------------------------

    def forward(self, ids: list[int], cache, group: StepGroup, token: str = "",
                all_positions: bool = False, routing: dict | None = None
                ) -> tuple[StepResult, object]:
        """Run ``ids`` after what ``cache`` (a KV cache, None for a new sequence) holds, in
        ``group``; returns the step's result and the cache. ``token``: the step's input
        token as text. ``all_positions``: the result also has every position's routing.
        ``routing``: a dict filled as the layers compute (layer -> (top-k index, weights):
        the experts fetched, see ``reroute``), which the caller keeps when the forward fails.
        The result's routing is the router's own choice."""
        ctx = self._local.ctx = ForwardContext(group, token)
        if routing is not None:
            ctx.routing = routing
        try:
            with torch.inference_mode():
                out = self.model(input_ids=torch.tensor([ids]), use_cache=True,
                                 **{self.cache_name: cache})
        finally:
            self._local.ctx = None
        rows = [ctx.chosen[layer] for layer in self.moe_layers]
        step = StepResult(out.logits[0, -1], [r[0][-1].tolist() for r in rows],
                          [r[1][-1].float().tolist() for r in rows], token,
                          rerouted=ctx.rerouted)
        if all_positions:
            step.positions = [([r[0][i].tolist() for r in rows],
                               [r[1][i].float().tolist() for r in rows])
                              for i in range(len(ids))]
        step.lookahead = ctx.lookahead
        return step, getattr(out, self.cache_name)

    @staticmethod
    def cache_mark(cache) -> list[int] | None:
        """What a KV cache holds, layer by layer, to ``rewind`` it to after a failed forward
        (None: a cache of a kind that cannot be rewound)."""
        layers = getattr(cache, "layers", None)
        if layers is None:
            return None
        return [layer.get_seq_length() for layer in layers]

    @staticmethod
    def rewind(cache, mark: list[int] | None) -> bool:
        """Drop what a failed forward added to ``cache`` (each layer back to its length in
        ``mark``: the forward stopped part-way, after some layers only); False when it
        cannot be done (a sliding window already full, a linear-attention state), and the
        sequence cannot go on."""
        if mark is None:
            return False
        try:
            for layer, length in zip(cache.layers, mark):
                grown = layer.get_seq_length() - length
                if grown > 0:
                    layer.crop(-grown)
        except (RuntimeError, ValueError, AttributeError, NotImplementedError):
            return False
        return True

    def solo_group(self, token: str = "") -> StepGroup:
        return StepGroup(1, lambda layer, experts, weights: self.fetch_layer(layer, experts,
                                                                            token, weights),
                         self.prefill_request_experts, self.dtype)

    def reset(self) -> None:
        """Start a new sequence (drops the KV cache)."""
        self.cache = None

    def step(self, ids: list[int], token: str = "") -> StepResult:
        """``ids`` after the runner's own KV cache, alone."""
        group = self.solo_group(token)
        with group.cond:
            step, self.cache = self.forward(ids, self.cache, group, token)
        return step

    def prefill(self, ids: list[int]) -> StepResult:
        """A new sequence: its prompt in one forward pass."""
        self.reset()
        return self.step(ids)

    def decode(self, token: int, token_text: str = "") -> StepResult:
        """One decode step: feed the previous step's token."""
        return self.step([token], token_text)
