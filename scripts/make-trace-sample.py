"""Cut the committed sample trace ``gptoss20b-sample`` out of the full gpt-oss-20b traces.

    python scripts/make-trace-sample.py [--traces-dir DIR]

Writes ``common/data/gptoss20b-sample/{train,eval}.npz`` (FlashMoE trace files): the whole
sequences of the train split that ``flashmoe run`` warms up on, and the first eval sequences
that hold at least ``SAMPLE_EVAL_TOKENS`` tokens. Deterministic: the same traces give the same files.
"""

from __future__ import annotations

import argparse

from common.traces import (SAMPLE_DIR, SAMPLE_EVAL_TOKENS, SAMPLE_TRAIN_TOKENS, find_traces_dir,
                           first_sequences, load_gptoss20b, save_trace)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces-dir", help="the full traces (default: as `flashmoe` finds them)")
    args = parser.parse_args()
    traces_dir = find_traces_dir(args.traces_dir)
    SAMPLE_DIR.mkdir(parents=True, exist_ok=True)
    for split, tokens in (("train", SAMPLE_TRAIN_TOKENS), ("eval", SAMPLE_EVAL_TOKENS)):
        full = load_gptoss20b(split, traces_dir)
        sample = first_sequences(full, tokens, cover=split == "eval")
        path = SAMPLE_DIR / f"{split}.npz"
        save_trace(sample, path)
        print(f"{path}: {sample.n_sequences} sequences, {sample.n_tokens} tokens, "
              f"{path.stat().st_size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
