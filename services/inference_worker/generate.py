"""Text generation through the expert cache, in-process: the worker's model-driven form.

``generate`` runs one prompt through the serving engine (``engine.py``, the same tokenization,
arithmetic and events as `flashmoe serve`), without HTTP: its experts come from a live cache
manager's arena (``arena_fetch``: one AcquireReq per MoE layer, the previous layer released in
it, the step's input token as the prefetcher's context). Each new token's text goes to
``on_token`` as soon as it is known; with ``events`` it publishes one AccessEvent per prompt
position (marked prefill) and per decode step. At the end it releases its pins and returns the
token ids with the cache manager's statistics.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from common.cache_client import CacheClient, ExpertLoadError
from common.config import FlashMoEConfig
from common.model_families import FAMILIES
from common.store import ExpertStore, StoreError

from .core import model_shape
from .engine import SamplingParams, token_text  # noqa: F401 - text_warmup's
from .events import EventPublisher
from .model_runner import Fetch, ModelRunner
from .quantized import QWeight

log = logging.getLogger("flashmoe.inference_worker")

NO_FREE_SLOT_WAIT_S = 0.002  # between tries while every free slot is still loading


def _acquire(client: CacheClient, layer: int, experts: list[int],
             release_layers: Sequence[int], token: str, weights: Sequence[float] = ()
             ) -> list[int]:
    """``client.acquire``, tried again while the cache manager has no slot to give because
    its unpinned slots are all loading (prefetches): they free up as loads complete. Bounded
    by ``ipc.acquire_timeout_s``."""
    deadline = time.monotonic() + client.config.ipc.acquire_timeout_s
    release = list(release_layers)
    while True:
        try:
            return client.acquire(layer, experts, release, token, weights)
        except ExpertLoadError as exc:
            if (exc.code != "no_free_slot" or len(set(experts)) > client.ready.n_slots
                    or time.monotonic() > deadline):
                raise
        release = []  # the failed request already dropped them
        time.sleep(NO_FREE_SLOT_WAIT_S)


def arena_fetch(client: CacheClient) -> Fetch:
    """A ``ModelRunner`` fetch that acquires experts from the cache manager and gives each
    expert's in-memory parameter slices (the store family's adapter) as zero-copy views of
    the arena."""
    arena, store = client.arena, client.store
    family = FAMILIES[store.manifest.model_family]
    precisions: dict[int, list[str]] = {}  # layer -> the precision of each expert fetched last
    # slot -> (layer, expert, precision, parameters) made last for it: a slot's pool (and so
    # its precision) is fixed, and views of an expert's bytes stay right while it is there
    made: dict[int, tuple[int, int, str, dict]] = {}

    def parameters(layer: int, expert: int, slot: int) -> tuple[str, dict]:
        known = made.get(slot)
        if known is not None and known[0] == layer and known[1] == expert:
            return known[2], known[3]
        precision, entry = client.expert_entry(layer, expert, slot)
        data = arena.span(slot, entry.nbytes)
        views = arena.torch_views(slot, entry)
        if precision == "native":
            params = family.expert_parameters(entry, data, views)
        else:
            params = copy_parameters(store.at(precision).manifest.quant, precision, views)
        if _all_views(params, entry, views):  # (kept only where nothing was copied)
            made[slot] = (layer, expert, precision, params)
        return precision, params

    def fetch(layer: int, experts: list[int], release_layers: Sequence[int], token: str,
              weights: Sequence[float] = ()) -> list[dict[str, torch.Tensor]]:
        slots = _acquire(client, layer, experts, release_layers, token, weights)
        out, got = [], []
        for expert, slot in zip(experts, slots):
            precision, params = parameters(layer, expert, slot)
            got.append(precision)
            out.append(params)
        precisions[layer] = got
        return out

    fetch.precisions = precisions
    return fetch


def _all_views(params: dict, entry, views: dict[str, torch.Tensor]) -> bool:
    """Whether every tensor of ``params`` (a QWeight's too) lies in the expert's bytes, which
    ``views`` (its projections, ``Arena.torch_views``) are views of: nothing was copied."""
    first = entry.tensors[0]
    start = views[first.name].data_ptr() - first.offset
    end = start + entry.nbytes
    for value in params.values():
        tensors = (value.q, value.scale) if isinstance(value, QWeight) else (value,)
        if not all(start <= t.data_ptr() < end for t in tensors):
            return False
    return True


def copy_parameters(quant: dict, precision: str, views: dict[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor | QWeight]:
    """One expert's in-memory parameters from its precision copy's views: each weight matrix
    a ``QWeight`` over the arena's bytes (no copy), each bias as it is."""
    out = {}
    for name, shape in quant["native_shapes"].items():
        if f"{name}.scale" in views:
            out[name] = QWeight(views[name], views[f"{name}.scale"], precision, shape,
                                name in quant["transposed"], quant["group_size"])
        else:
            out[name] = views[name]
    return out


def store_model_shape(store_path: str | Path) -> dict[str, int]:
    """The handshake's shape of the model a store holds (``core.model_shape``)."""
    manifest = ExpertStore.open(store_path).manifest
    return model_shape(len(manifest.moe_layers), manifest.num_experts, manifest.top_k)


def load_tokenizer(store_path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(store_path))
    except (OSError, ValueError) as exc:
        raise StoreError(f"{store_path}: no usable tokenizer in the store ({exc}); convert a "
                         f"checkpoint folder that has its tokenizer files") from None


def same_store(served: ExpertStore, store_path: Path) -> bool:
    if served.path.resolve() == store_path.resolve():
        return True
    try:
        return ExpertStore.open(store_path).manifest == served.manifest
    except StoreError:
        return False


def generate(store_path: str | Path, prompt: str, max_new_tokens: int, cache_endpoint: str,
             config: FlashMoEConfig | None = None, events: str | None = None,
             on_token: Callable[[str], None] | None = None, *, name: str = "worker",
             settle_s: float = 0.5, params: SamplingParams | None = None) -> dict:
    """Up to ``max_new_tokens`` new tokens (greedy unless ``params`` say otherwise), through
    the same engine as `flashmoe serve` (in this process, no HTTP): the prompt tokenized as
    ``/v1/completions`` does, the same arithmetic, the same events. ``on_token`` gets each
    piece of new text as soon as it is known. Returns ``prompt_ids``, ``token_ids`` (the new
    tokens), ``text``, ``finish_reason``, ``stats`` (the cache manager's, after the engine
    released its pins), ``prefill_s``, ``decode_s`` and ``decode_steps``."""
    from .api import encode_prompt
    from .engine import Engine, Request

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    store_path = Path(store_path)
    settings = config or FlashMoEConfig()
    tokenizer = load_tokenizer(store_path)
    prompt_ids = encode_prompt(tokenizer, prompt)
    if not prompt_ids:
        raise ValueError("the prompt gives no tokens")
    params = params or SamplingParams(temperature=0.0)
    params.max_tokens = max_new_tokens
    publisher = EventPublisher(settings, events, f"{name}[{os.getpid()}]") if events else None
    try:
        if publisher is not None:
            time.sleep(settle_s)  # the subscribers' time to connect
        with CacheClient(cache_endpoint, config, name=name,
                         shape=store_model_shape(store_path)) as client:
            if not same_store(client.store, store_path):
                raise StoreError(f"the cache manager at {cache_endpoint} serves "
                                 f"{client.store.path}, not the store {store_path}")
            runner = ModelRunner(store_path, arena_fetch(client))
            runner.lookahead = settings.prefetch.router_lookahead
            engine = Engine(runner, tokenizer, client.ready.n_slots, release=client.release,
                            hint=client.prefetch if runner.lookahead else None,
                            publisher=publisher,
                            set_step=lambda step: setattr(client, "step", step),
                            lost=client.lost,
                            max_queue=1, max_batch=1)
            engine.clamp(prompt_ids, params)
            pieces, times, done = [], [], {}

            def emit(kind: str, payload) -> None:
                if kind == "text":
                    times.append(time.monotonic())
                    pieces.append(payload)
                    if on_token:
                        on_token(payload)
                elif kind == "done":
                    done.update(payload)
                else:
                    done["error"] = payload

            started = time.monotonic()
            engine.submit(Request(prompt_ids, params, emit))
            while not done:
                engine.turn()
            if "error" in done:
                raise done["error"]
            client.release()
            stats = client.stats()
    finally:
        if publisher is not None:
            publisher.close()
    log.info("generated %d tokens from a %d-token prompt", done["completion_tokens"],
             len(prompt_ids))
    prefill_s = times[0] - started
    return {"prompt_ids": prompt_ids, "token_ids": done["token_ids"], "text": "".join(pieces),
            "finish_reason": done["finish_reason"], "stats": stats, "prefill_s": prefill_s,
            "decode_s": times[-1] - times[0], "decode_steps": len(times) - 1,
            "lookahead_recall": engine.lookahead_recall()}
