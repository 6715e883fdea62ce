"""The inference worker's decision core: what it asks the cache manager for, and when.

One AcquireReq per MoE layer as soon as that layer's routing is known, in token-major then
layer-major order, holding the layer it computes and dropping the one before it in the same
message (``release_layers``): pins never cover more than two layers of one worker. The trace
simulator (`flashmoe bench --mode core`) replays the same schedule against the same cache
core, which is what makes its hit counts those of the live system.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np


def previous_layer(layer: int, num_layers: int) -> int:
    """The layer computed just before ``layer`` (the previous token's last one for layer 0)."""
    return layer - 1 if layer else num_layers - 1


def token_schedule(row: list[list[int]]) -> Iterator[tuple[int, list[int], tuple[int]]]:
    """(layer, experts, release_layers) of one token's AcquireReqs, ``row`` its routing per
    layer (the live worker does a token at a time: a failed one is skipped or done again)."""
    for layer, selected in enumerate(row):
        yield layer, selected, (previous_layer(layer, len(row)),)


def acquire_schedule(experts: np.ndarray) -> Iterator[tuple[int, int, list[int], tuple[int]]]:
    """(token, layer, experts, release_layers) of every AcquireReq for a routing array of
    shape (tokens, layers, top_k), rows in the router's order."""
    for token, row in enumerate(experts.tolist()):
        for layer, selected, release in token_schedule(row):
            yield token, layer, selected, release


def model_shape(layers: int, experts: int, top_k: int, expert_bytes: int = 0) -> dict[str, int]:
    """The model's shape a worker sends in its handshake (``CacheClient(shape=)``), for the
    cache manager to refuse a worker of another model: MoE layers, experts a layer, top-k and
    the bytes of an expert (0: unknown, not compared)."""
    return {"layers": int(layers), "experts": int(experts), "top_k": int(top_k),
            "expert_bytes": int(expert_bytes)}
