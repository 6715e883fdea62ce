"""Hit counts of every policy at several capacities on the warp OLMoE trace, against the
committed goldens (regenerate deliberately: `python -m tests.goldens.regenerate --write`)."""

import json

import pytest

from tests.support.goldens import GOLDEN_PATH, compute

pytestmark = pytest.mark.traces


def test_goldens_on_warp_olmoe():
    committed = json.loads(GOLDEN_PATH.read_text())
    assert compute() == committed
    hits = committed["hits"]
    for scope in ("global", "layer"):
        for capacity, by_policy in hits[scope].items():
            assert max(by_policy.values()) == by_policy["belady"], (scope, capacity)
            for name, core in committed["core_hits"][scope][capacity].items():
                assert core is None or core <= by_policy["belady"], (name, scope, capacity)
