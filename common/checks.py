"""What the learning path checks of a well-formed bus message before it touches any state.

The bus decodes a message by its schema (types, lengths); these checks hold its values
against the model and the session: a token's routing has one row per MoE layer, top-k
distinct expert ids below the layer's expert count, router probabilities of the same shape
and finite. A message that fails raises ``Dropped`` with a short ``reason``; the services
count it as ``dropped_<reason>`` in their stats, log it at a bounded rate and go on. The
feature extractor checks AccessEvents with these; the predictor's ``check_batch`` checks a
FeatureBatch's routing with ``check_routing`` and its feature buffers itself.
"""

from __future__ import annotations

import numpy as np


PROB_SLACK = 1e-3  # a router probability stored in float16 may round a little past 1


class Dropped(ValueError):
    """A message whose values do not fit the model or the session; ``reason`` names the
    check (a stats counter ``dropped_<reason>``)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def check_routing(experts, layers: int, num_experts: int, top_k: int) -> np.ndarray:
    """A token's routing as an (layers, top_k) int64 array of distinct ids in [0, E) per
    row; ``Dropped`` (``layers``, ``top_k``, ``expert_range``, ``duplicate_expert``)."""
    if len(experts) != layers:
        raise Dropped("layers", f"{len(experts)} rows of routing, the model has {layers} MoE "
                                f"layers")
    if any(len(row) != top_k for row in experts):
        raise Dropped("top_k", f"rows of {sorted({len(row) for row in experts})} experts, the "
                               f"model routes {top_k} a layer")
    try:
        routing = np.asarray(experts, np.int64).reshape(layers, top_k)
    except (OverflowError, TypeError, ValueError):  # an id past int64, or not an id
        raise Dropped("expert_range", "an expert id that is no int64") from None
    if routing.size and (routing.min() < 0 or routing.max() >= num_experts):
        raise Dropped("expert_range", f"expert ids in [{int(routing.min())}, "
                                      f"{int(routing.max())}], the model has {num_experts} a "
                                      f"layer")
    if top_k > 1:
        ordered = np.sort(routing, axis=1)
        if (ordered[:, 1:] == ordered[:, :-1]).any():
            raise Dropped("duplicate_expert", "an expert twice in one layer's top-k")
    return routing


def check_probs(probs, layers: int, top_k: int) -> np.ndarray | None:
    """Router probabilities: [] (unknown: None) or (layers, top_k) finite values in [0, 1];
    ``Dropped`` (``probs_shape``, ``probs_value``)."""
    if probs is None or len(probs) == 0:
        return None
    if len(probs) != layers or any(len(row) != top_k for row in probs):
        raise Dropped("probs_shape", f"probabilities of {len(probs)} rows, expected {layers} "
                                     f"rows of {top_k}")
    values = np.asarray(probs, np.float64)
    if not np.isfinite(values).all() or values.min() < 0 or values.max() > 1 + PROB_SLACK:
        raise Dropped("probs_value", "router probabilities outside [0, 1] or not finite")
    return values.astype(np.float32)
