"""The policy goldens on the warp OLMoE trace: what the code gives now, and where the committed
ones lie (tests/goldens/; `python -m tests.goldens.regenerate` prints and rewrites them).

``hits``: the per-request replay (libCacheSim's protocol) of every policy it can run;
``core_hits``: the layer-aware policies through the cache manager's core (the learned one, which
needs the learning path, is measured by `flashmoe bench`).
"""

from __future__ import annotations

from pathlib import Path

from common.traces import load_trace
from flashmoe.sim.device_model import DEVICES
from flashmoe.sim.replay import build_requests, capacity_for, replay, replay_core
from services.cache_manager.core import AcquireFailed
from services.cache_manager.policies import POLICIES, needs_core

GOLDEN_PATH = Path(__file__).resolve().parents[1] / "goldens" / "warp_olmoe.json"
TRACE = "warp:olmoe"
FRACTIONS = (0.0625, 0.125, 0.25, 0.5)
SCOPES = ("global", "layer")


def core_hits(name: str, capacity: int, trace, scope: str) -> int | None:
    """Hits through the cache manager's core; None where the pins of one request do not fit
    (a layer's top-k above its capacity in the layer scope)."""
    try:
        return int(replay_core(name, capacity, trace, scope, DEVICES["orin-980pro"], 1,
                               0.0).stats["n_hit"])
    except AcquireFailed:
        return None


def compute() -> dict:
    trace = load_trace(TRACE)
    goldens: dict = {"trace": TRACE, "hits": {}}
    for scope in SCOPES:
        requests = build_requests(trace, scope)
        goldens["hits"][scope] = {}
        for fraction in FRACTIONS:
            capacity = capacity_for(fraction, trace, scope)
            goldens["hits"][scope][str(capacity)] = {
                name: int(replay(name, capacity, requests).sum())
                for name in sorted(POLICIES) if not needs_core(name)}
            goldens.setdefault("core_hits", {}).setdefault(scope, {})[str(capacity)] = {
                name: core_hits(name, capacity, trace, scope)
                for name in sorted(POLICIES) if needs_core(name)
                and not getattr(POLICIES[name], "accepts_estimates", False)}
        goldens[f"{scope}_accesses"] = int(len(requests.keys))
    return goldens

