"""What the feature extractor shares with its peers through the cluster (common/cluster.py
carries it): the share of tokens that used each expert (``popularity``), the per-layer
transition counts (``transitions``) and the online PCA (``pca``); the shapes those arrays have
on this device; and a peers' warm start taken into its tables.
"""

from __future__ import annotations

import numpy as np

from common.cluster import ArraySpecs, Patterns, WarmStart

from .core import FEATURES, RAW, ExtractorCore

PCA_COUNTERS = 3  # OnlinePCA.state()["counters"]: n, weight, variance kept


def predictor_inputs(experts: int, pca_components: int) -> tuple[int, int]:
    """(dims, features) of what the extractor hands the predictor: the per-layer vector after
    the PCA (the raw vector itself without one) and the per-expert feature count."""
    dim = experts * len(RAW)
    return min(pca_components, dim) or dim, len(FEATURES)


def shared_arrays(layers: int, experts: int, pca_components: int) -> ArraySpecs:
    """The extractor's shared values on this device: {what: {array: (dtype, shape)}}."""
    L, E = layers, experts
    D = E * len(RAW)  # the raw per-layer vector
    k = min(pca_components, D)
    f32 = np.dtype(np.float32)
    return {"popularity": {"popularity": (f32, (L * E,))},
            "transitions": {"counts": (f32, (L, E, E)), "rows": (f32, (L, E))},
            "pca": {"mean": (f32, (D,)), "cov": (f32, (D, D)),
                    "basis": (f32, (k, D) if k else (0,)),
                    "counters": (np.dtype(np.float64), (PCA_COUNTERS,))}}


def extractor_patterns(core: ExtractorCore, device: str) -> Patterns:
    """A copy of what an ``ExtractorCore`` learned (cheap: call it under the service's lock,
    encode outside it)."""
    fx = core.features
    rows = len(fx.token_row)
    seen = float(fx.token_seen[:rows].sum())
    popularity = fx.token_uses[:rows].sum(0) / seen if seen else np.zeros(fx.N, np.float32)
    pca = core.pca.state()
    return Patterns(device, int(fx.t), popularity.astype(np.float32),
                    fx.transition_counts.copy(), fx.transition_sources.copy(),
                    {"mean": pca["mean"].astype(np.float32), "cov": pca["cov"].astype(np.float32),
                     "basis": np.asarray(pca["basis"], np.float32),
                     "counters": np.asarray(pca["counters"], np.float64)})


def apply_to_extractor(core: ExtractorCore, warm: WarmStart, local_tokens: int = 0) -> None:
    """Start an ``ExtractorCore`` from a warm start: its long-run popularity (the prior every
    table estimate is smoothed towards) and transition counts become the token-weighted mix
    of the peers' and its own (``local_tokens``: what its own tables cover, e.g. a warm-up
    checkpoint's), and it takes the PCA the chosen peer's predictor was trained on."""
    fx = core.features
    own = local_tokens / (local_tokens + warm.tokens) if local_tokens else 0.0
    fx.long_run_freq = (own * fx.long_run_freq + (1 - own) * warm.popularity).astype(np.float32)
    fx.transition_counts = fx.transition_counts + warm.transitions
    fx.transition_sources = fx.transition_sources + warm.transition_rows
    if warm.pca is not None:
        core.pca.load_state({"mean": warm.pca["mean"].astype(np.float64),
                             "cov": warm.pca["cov"].astype(np.float64),
                             "basis": warm.pca["basis"], "counters": warm.pca["counters"]})
