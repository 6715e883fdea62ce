"""Cross-check against libCacheSim (a test-only, GPL peer) on the shared gpt-oss-20b traces.

Pitfalls handled: object size 1, a fresh libCacheSim cache per cache lifetime (per sequence
and layer in the layer scope), Belady fed each request's next access time (INT64_MAX for none).
The first SEQUENCES sequences of the eval split keep the run short; set CROSSCHECK_SEQUENCES=218
to check the whole split (about 25 minutes here).
"""

import os

import numpy as np
import pytest

from common.traces import Trace, load_trace
from flashmoe.sim.replay import build_requests, capacity_for, next_use_positions, replay
from services.cache_manager.policies.belady import NEVER

lcs = pytest.importorskip("libcachesim", reason="libcachesim (test-only peer) not installed")
pytestmark = [pytest.mark.slow, pytest.mark.traces]

SEQUENCES = int(os.environ.get("CROSSCHECK_SEQUENCES", "40"))
FRACTIONS = (0.0625, 0.125, 0.25, 0.5)
LCS = {"lru": "LRU", "fifo": "FIFO", "arc": "ARC", "sieve": "Sieve", "belady": "Belady",
       "s3fifo": "S3FIFO", "lirs": "LIRS"}


@pytest.fixture(scope="module")
def requests_by_scope():
    full = load_trace("gptoss20b:eval")
    end = full.offsets[SEQUENCES]
    trace = Trace("eval-head", full.experts[:end], full.offsets[:SEQUENCES + 1],
                  full.num_experts, full.model)
    return trace, {scope: build_requests(trace, scope) for scope in ("global", "layer")}


def libcachesim_hits(name: str, capacity: int, requests) -> int:
    keys, starts = requests.keys.tolist(), requests.starts.tolist()
    nxt = [t if t < NEVER else np.iinfo(np.int64).max for t in next_use_positions(requests).tolist()]
    cls = getattr(lcs, LCS[name])
    hits = 0
    for a, b in zip(starts[:-1], starts[1:]):
        cache = cls(capacity, hashpower=12)  # the default (2^24 buckets) is slow to allocate
        req = lcs.Request()
        req.obj_size = 1
        for i in range(a, b):
            req.obj_id = keys[i]
            req.next_access_vtime = nxt[i]
            hits += bool(cache.get(req))
    return hits


@pytest.mark.parametrize("scope", ["global", "layer"])
@pytest.mark.parametrize("name", ["lru", "fifo", "arc", "sieve", "belady"])
def test_exact_agreement(requests_by_scope, scope, name):
    trace, by_scope = requests_by_scope
    for fraction in FRACTIONS:
        capacity = capacity_for(fraction, trace, scope)
        ours = int(replay(name, capacity, by_scope[scope]).sum())
        assert ours == libcachesim_hits(name, capacity, by_scope[scope]), (scope, capacity)


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_s3fifo_within_half_a_point(requests_by_scope, scope):
    trace, by_scope = requests_by_scope
    n = len(by_scope[scope].keys)
    # libCacheSim's S3-FIFO admits nothing when its small FIFO holds a single object (an
    # object must be smaller than the small FIFO) and refuses an empty one, so it needs a
    # capacity of 20 or more: the layer scope is checked at 20, 24 and 28 of 32 experts.
    capacities = ([capacity_for(f, trace, scope) for f in FRACTIONS] if scope == "global"
                  else [20, 24, 28])
    for capacity in capacities:
        ours = int(replay("s3fifo", capacity, by_scope[scope]).sum())
        theirs = libcachesim_hits("s3fifo", capacity, by_scope[scope])
        assert abs(ours - theirs) / n * 100 <= 0.5, (scope, capacity, ours, theirs)


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_lirs_within_one_and_a_half_points(requests_by_scope, scope):
    trace, by_scope = requests_by_scope
    n = len(by_scope[scope].keys)
    for fraction in FRACTIONS:
        capacity = capacity_for(fraction, trace, scope)
        if capacity < 4:
            continue  # libCacheSim's LIRS over-fills tiny caches: see the test below
        ours = int(replay("lirs", capacity, by_scope[scope]).sum())
        theirs = libcachesim_hits("lirs", capacity, by_scope[scope])
        assert abs(ours - theirs) / n * 100 <= 1.5, (scope, capacity, ours, theirs)


def test_libcachesim_lirs_overfills_a_two_expert_cache(requests_by_scope):
    """Why capacity 2 is left out above: libCacheSim's LIRS then keeps more experts findable
    than its capacity (an HIR hit outside S evicts the resident HIR and still marks it
    resident), so its hit count there is not a fair reference."""
    _, by_scope = requests_by_scope
    req = by_scope["layer"]
    cache, probe, worst = lcs.LIRS(2, hashpower=12), lcs.Request(), 0
    request = lcs.Request()
    request.obj_size = probe.obj_size = 1
    for key in req.keys[req.starts[0]:req.starts[1]].tolist():
        request.obj_id = key
        cache.get(request)
        resident = 0
        for expert in range(32):
            probe.obj_id = expert
            resident += cache.find(probe, False) is not None
        worst = max(worst, resident)
    assert worst > 2
