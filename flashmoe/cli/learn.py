"""Commands that make what the learned policy learns from: warmup (pre-training on a routing
trace or a text), trace record (a model's router decisions)."""

from __future__ import annotations

import json

from flashmoe.cli.options import (add_config_flags, add_quiet, add_trace, config,
                                  non_negative_int, positive_int, trace_of)
from flashmoe.errors import UsageError


def cmd_warmup(args) -> int:
    from tqdm import tqdm

    from flashmoe.sim.learning import warmup

    if args.text:
        from flashmoe.tools.text_warmup import warmup_from_text

        if not args.store:
            raise UsageError("--text needs --store (the model that reads the text)")
        summary = warmup_from_text(args.store, args.text, args.out, config(args, args.store),
                                   max_tokens=args.max_tokens, passes=args.passes)
        print(json.dumps(summary))
        print(f"wrote {args.out}")
        return 0
    trace = trace_of(args)
    with tqdm(total=trace.n_tokens * args.passes, unit="tok", desc="warmup",
              disable=True if args.quiet else None) as bar:
        summary = warmup(trace, config(args), args.out, progress=bar.update,
                         passes=args.passes)
    print(json.dumps(summary))
    print(f"wrote {args.out}")
    return 0


def cmd_trace_record(args) -> int:
    from flashmoe.tools.trace_record import record_trace

    trace = record_trace(args.model, args.prompts, args.out, max_new_tokens=args.max_new_tokens)
    print(f"{args.out}: {trace.n_sequences} sequences, {trace.n_tokens} decode tokens, "
          f"{trace.num_layers} MoE layers x top-{trace.top_k} of {trace.num_experts} experts")
    return 0


def register(sub) -> None:
    p = sub.add_parser("warmup", help="pre-train the learned policy (feature tables and the "
                                      "predictor) on a routing trace")
    add_trace(p, default="gptoss20b:train")
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--passes", type=non_negative_int, default=2,
                   help="online passes over the trace (0: a cold checkpoint)")
    p.add_argument("--store", help="with --text: the store whose model reads the text")
    p.add_argument("--text", help="a text file: run the store's model over it, record its "
                                  "routing and train on that (instead of --trace)")
    p.add_argument("--max-tokens", type=positive_int,
                   help="with --text: read at most this many tokens")
    add_quiet(p)
    add_config_flags(p)
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("trace", help="routing traces")
    trace_sub = p.add_subparsers(dest="trace_command", required=True)
    p = trace_sub.add_parser("record", help="record a transformers MoE model's router decisions")
    p.add_argument("--model", required=True, help="local Hugging Face model folder")
    p.add_argument("--prompts", required=True,
                   help="JSONL: {\"text\": ...} (needs a tokenizer) or {\"input_ids\": [...]}")
    p.add_argument("--out", required=True, help="trace file to write (.npz)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.set_defaults(func=cmd_trace_record)
