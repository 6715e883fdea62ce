"""Print (and with --write, store) the policy goldens on the warp OLMoE trace.

    .venv/bin/python -m tests.goldens.regenerate           # print what the code gives now
    .venv/bin/python -m tests.goldens.regenerate --write   # overwrite the committed goldens

Regenerate deliberately, after a reviewed change of a policy's behaviour; the test compares
against the committed file. What is computed: tests/support/goldens.py.
"""

from __future__ import annotations

import argparse
import json

from tests.support.goldens import GOLDEN_PATH, compute


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
