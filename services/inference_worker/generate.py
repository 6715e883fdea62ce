"""Text generation through the expert cache: the worker's model-driven form.

``generate`` tokenizes a prompt with the store's tokenizer, prefills it and decodes greedily
with a KV cache through ``ModelRunner``, whose experts come from a live cache manager's arena
(``arena_fetch``: one AcquireReq per MoE layer, the previous layer released in it, the step's
input token as the prefetcher's context). Each new token's text goes to ``on_token`` as soon
as it is known; with ``events`` the worker publishes one AccessEvent per decode step (every
MoE layer's top-k and routing weights, the input token and the token it produced). At the end
it releases its pins and returns the token ids with the cache manager's statistics.
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

from .events import EventPublisher
from .model_runner import Fetch, ModelRunner

log = logging.getLogger("flashmoe.inference_worker")

NO_FREE_SLOT_WAIT_S = 0.002  # between tries while every free slot is still loading


def _acquire(client: CacheClient, layer: int, experts: list[int],
             release_layers: Sequence[int], token: str) -> list[int]:
    """``client.acquire``, tried again while the cache manager has no slot to give because
    its unpinned slots are all loading (prefetches): they free up as loads complete. Bounded
    by ``ipc.acquire_timeout_s``."""
    deadline = time.monotonic() + client.config.ipc.acquire_timeout_s
    release = list(release_layers)
    while True:
        try:
            return client.acquire(layer, experts, release, token)
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

    def fetch(layer: int, experts: list[int], release_layers: Sequence[int], token: str
              ) -> list[dict[str, torch.Tensor]]:
        slots = _acquire(client, layer, experts, release_layers, token)
        out = []
        for expert, slot in zip(experts, slots):
            entry = store.expert(layer, expert)
            out.append(family.expert_parameters(entry, arena.slot(slot),
                                                arena.torch_views(slot, entry)))
        return out

    return fetch


def load_tokenizer(store_path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(store_path))
    except (OSError, ValueError) as exc:
        raise StoreError(f"{store_path}: no usable tokenizer in the store ({exc}); convert a "
                         f"checkpoint folder that has its tokenizer files") from None


def token_text(tokenizer, token: int) -> str:
    """A token as text for events and the prefetcher (never empty: "" means 'no token')."""
    return tokenizer.decode([token]) or tokenizer.convert_ids_to_tokens(token) or f"<{token}>"


class TextStream:
    """Turns a growing list of token ids into the new text each token adds, holding back a
    piece that ends inside a UTF-8 character (byte-level tokens can split one) until a later
    token completes it or the last token flushes it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, token: int, last: bool = False) -> str:
        self.ids.append(token)
        text = self.text()
        if text.endswith("\ufffd") and not last:
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


def _same_store(served: ExpertStore, store_path: Path) -> bool:
    if served.path.resolve() == store_path.resolve():
        return True
    try:
        return ExpertStore.open(store_path).manifest == served.manifest
    except StoreError:
        return False


def generate(store_path: str | Path, prompt: str, max_new_tokens: int, cache_endpoint: str,
             config: FlashMoEConfig | None = None, events: str | None = None,
             on_token: Callable[[str], None] | None = None, *, name: str = "worker",
             sequence: int = 0, settle_s: float = 0.5) -> dict:
    """Greedy decoding of up to ``max_new_tokens`` new tokens (fewer at an end-of-sequence
    token). ``on_token`` is called once per new token, as soon as it is chosen, with the text
    it adds (possibly "", see ``TextStream``). Returns ``prompt_ids``, ``token_ids`` (the new
    tokens), ``text``, ``stats`` (the cache manager's, after this worker released its pins),
    ``prefill_s``, ``decode_s`` and ``decode_steps``."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    store_path = Path(store_path)
    tokenizer = load_tokenizer(store_path)
    prompt_ids = list(tokenizer(prompt)["input_ids"])
    if not prompt_ids:
        raise ValueError("the prompt gives no tokens")
    publisher = EventPublisher(config or FlashMoEConfig(), events, f"{name}[{os.getpid()}]") \
        if events else None
    try:
        if publisher is not None:
            time.sleep(settle_s)  # the subscribers' time to connect
        with CacheClient(cache_endpoint, config, name=name) as client:
            if not _same_store(client.store, store_path):
                raise StoreError(f"the cache manager at {cache_endpoint} serves "
                                 f"{client.store.path}, not the store {store_path}")
            runner = ModelRunner(store_path, arena_fetch(client))
            eos = runner.eos_token_ids | ({tokenizer.eos_token_id}
                                          if tokenizer.eos_token_id is not None else set())
            stream = TextStream(tokenizer)
            started = time.monotonic()
            step = runner.prefill(prompt_ids)
            prefill_s = time.monotonic() - started
            token = int(step.logits.argmax())
            generated = [token]
            last = max_new_tokens == 1 or token in eos
            if on_token:
                on_token(stream.push(token, last))
            while not last:
                # The AccessEvent published below gets this seq: the acquires say so.
                client.step = publisher.seq if publisher is not None else -1
                step = runner.decode(token, token_text(tokenizer, token))
                following = int(step.logits.argmax())
                generated.append(following)
                last = len(generated) >= max_new_tokens or following in eos
                if publisher is not None:
                    publisher.publish(sequence, len(generated) - 2,
                                      token_text(tokenizer, token),
                                      "" if last else token_text(tokenizer, following),
                                      step.experts, step.probs)
                token = following
                if on_token:
                    on_token(stream.push(token, last))
            decode_s = time.monotonic() - started - prefill_s
            client.release()
            stats = client.stats()
    finally:
        if publisher is not None:
            publisher.close()
    log.info("generated %d tokens from a %d-token prompt", len(generated), len(prompt_ids))
    return {"prompt_ids": prompt_ids, "token_ids": generated, "text": stream.text(),
            "stats": stats, "prefill_s": prefill_s, "decode_s": decode_s,
            "decode_steps": len(generated) - 1}
