"""Print (and with --write, store) the policy goldens on the warp OLMoE trace.

    .venv/bin/python -m tests.goldens.regenerate           # print what the code gives now
    .venv/bin/python -m tests.goldens.regenerate --write   # overwrite the committed goldens

Regenerate deliberately, after a reviewed change of a policy's behaviour; the test compares
against the committed file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.traces import load_trace
from flashmoe.simulator import build_requests, capacity_for, replay
from services.cache_manager.policies import POLICIES

GOLDEN_PATH = Path(__file__).with_name("warp_olmoe.json")
TRACE = "warp:olmoe"
FRACTIONS = (0.0625, 0.125, 0.25, 0.5)
SCOPES = ("global", "layer")


def compute() -> dict:
    trace = load_trace(TRACE)
    goldens: dict = {"trace": TRACE, "hits": {}}
    for scope in SCOPES:
        requests = build_requests(trace, scope)
        goldens["hits"][scope] = {}
        for fraction in FRACTIONS:
            capacity = capacity_for(fraction, trace, scope)
            goldens["hits"][scope][str(capacity)] = {
                name: int(replay(name, capacity, requests).sum()) for name in sorted(POLICIES)}
        goldens[f"{scope}_accesses"] = int(len(requests.keys))
    return goldens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    goldens = compute()
    text = json.dumps(goldens, indent=1, sort_keys=True) + "\n"
    print(text, end="")
    if args.write:
        GOLDEN_PATH.write_text(text)
        print(f"wrote {GOLDEN_PATH}")


if __name__ == "__main__":
    main()
