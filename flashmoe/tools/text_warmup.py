"""Warm-up from text: run a store's model over a text file, record its routing, and pre-train
the learned policy on it (`flashmoe warmup --store STORE --text FILE`).

What a user has is text, not a routing trace: the file is cut into sequences at blank lines
(paragraphs; long ones split every ``tokens_per_sequence`` tokens), and each sequence is run
through the model token by token (teacher-forced: token i is the input of step i + 1, as in
decoding), with the experts coming from a live cache manager's arena exactly as in
`flashmoe generate`. The routing of every step becomes a trace (saved beside the
checkpoint as ``text_trace.npz``) on which ``flashmoe.sim.learning.warmup`` trains.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from common.cache_client import CacheClient
from common.config import FlashMoEConfig
from common.traces import Trace, save_trace

TOKENS_PER_SEQUENCE = 256


def text_sequences(text: str, tokenizer, tokens_per_sequence: int = TOKENS_PER_SEQUENCE,
                   max_tokens: int | None = None) -> list[list[int]]:
    """Token ids per sequence: paragraphs of the text, long ones cut, at most ``max_tokens``
    tokens in all; sequences shorter than 2 tokens are dropped (no decode step)."""
    out, total = [], 0
    for paragraph in text.split("\n\n"):
        ids = list(tokenizer(paragraph.strip())["input_ids"]) if paragraph.strip() else []
        for i in range(0, len(ids), tokens_per_sequence):
            piece = ids[i:i + tokens_per_sequence]
            if max_tokens is not None:
                piece = piece[:max(0, max_tokens - total)]
            if len(piece) >= 2:
                out.append(piece)
                total += len(piece)
    return out


def record_text_routing(store_path: str | Path, text_file: str | Path, cache_endpoint: str,
                        config: FlashMoEConfig, max_tokens: int | None = None,
                        progress=None) -> Trace:
    from services.inference_worker.generate import arena_fetch, load_tokenizer, token_text
    from services.inference_worker.model_runner import ModelRunner

    store_path = Path(store_path)
    text = Path(text_file).read_text(encoding="utf-8", errors="replace")
    tokenizer = load_tokenizer(store_path)
    sequences = text_sequences(text, tokenizer, max_tokens=max_tokens)
    if not sequences:
        raise ValueError(f"{text_file}: no text to run the model over")
    rows, probs, offsets, meta = [], [], [0], []
    with CacheClient(cache_endpoint, config, name="text-warmup") as client:
        runner = ModelRunner(store_path, arena_fetch(client))
        for n, ids in enumerate(sequences):
            runner.reset()
            runner.step(ids[:1], token_text(tokenizer, ids[0]))
            for token in ids[1:]:
                step = runner.decode(token, token_text(tokenizer, token))
                rows.append(step.experts)
                probs.append(step.probs)
                if progress is not None:
                    progress(1)
            offsets.append(len(rows))
            meta.append({"dataset": Path(text_file).name, "sequence": n,
                         "n_decode_tokens": len(ids) - 1,
                         # each step's input token (what the AccessEvent carries)
                         "generated_only": [token_text(tokenizer, t) for t in ids[1:]]})
        client.release()
        num_experts = client.store.manifest.num_experts
    experts = np.asarray(rows, np.int16)
    return Trace(Path(text_file).name, experts, np.asarray(offsets, np.int64), num_experts,
                 str(store_path), np.asarray(probs, np.float16), meta)


def warmup_from_text(store_path: str | Path, text_file: str | Path, out: str | Path,
                     config: FlashMoEConfig, max_tokens: int | None = None,
                     passes: int = 2, say=print) -> dict:
    """Record the routing of ``text_file`` through a cache manager started for it, then
    pre-train on it; returns the warm-up's summary."""
    from flashmoe.runtime.launch import Launcher
    from flashmoe.sim.learning import warmup

    with tempfile.TemporaryDirectory(prefix="flashmoe-warmup-") as runtime:
        launcher = Launcher(config, Path(runtime))
        try:
            endpoint = launcher.start("cache", ["serve-cache", str(store_path)]).endpoint
            trace = record_text_routing(store_path, text_file, endpoint, config, max_tokens)
        finally:
            launcher.stop_all()
    say(f"recorded {trace.n_tokens} decode steps in {trace.n_sequences} sequences of "
        f"{text_file}")
    summary = warmup(trace, config, out, passes=passes)
    save_trace(trace, Path(out) / "text_trace.npz")
    return summary
