"""`flashmoe precision-report`: what computing the experts from INT8 and INT4 copies does to a
model's outputs (common/quant.py's format, the worker's ``QWeight`` products).

Rows, per precision (native, int8, int4):

- each model family (Qwen3-MoE, OLMoE, Mixtral, GPT-OSS) as a tiny random-weight bf16 model
  built from its config (tools/tiny_models.py's ``tiny_config``, a fixed seed), run twice over
  a few prompts of random token ids: once as it is, once with every expert's weight matrices
  quantized and computed as the worker computes them (transformers' eager experts code on
  ``QWeight`` slices; the quantized run routes by its own hidden states).
  ``mean_rel_error``: ||y_q - y|| / ||y|| of each MoE block's output (the experts' weighted
  sum, before the residual add), per token, averaged over tokens and layers, where y is the
  bf16 experts' output on the same input and routing (a block's own error, hooks on the
  quantized run's experts modules); ``carried_rel_error``: the same between the two runs'
  outputs (the errors of earlier layers and their routing changes carried in);
  ``kl``: mean KL(p_native || p_quantized) of the next-token distributions; ``top1_agreement``:
  the fraction of positions whose argmax agrees; ``ties``: positions whose native top two
  logits are exactly equal (bf16 ties, where the argmax is a coin toss for any precision);
- the real expert shape of the end-to-end benchmark (``--shape``, ``--scale``: GPT-OSS
  projections at `flashmoe synth-store`'s scaled intermediate, random bf16 weights cut from
  synth-store's random pool): ``mean_rel_error`` of one MoE block for random hidden states
  routed top-k with softmax weights over a handful of experts, over a few layers; no logits,
  so ``kl``, ``top1_agreement`` and ``ties`` are null.

The errors do not depend on the RAM budget; ``--budget`` is recorded so that the report sits
beside the e2e benchmark's run of the same budget.
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np

from flashmoe.cli.options import add_json, save

PRECISIONS = ("native", "int8", "int4")
TINY_FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "gpt_oss")
# The tiny models: the test suite's shape (tests/conftest.py), whose expert intermediate (48)
# is not a multiple of the INT4 group, so the padded group is measured too.
TINY_SHAPE = dict(layers=2, experts=8, top_k=2, hidden=64, expert_intermediate=48)
PROMPTS, POSITIONS = 4, 32
# The real-shape rows: layers, experts per layer, tokens per layer.
SHAPE_LAYERS, SHAPE_EXPERTS, SHAPE_TOKENS = 3, 8, 16


def rel_errors(y_q, y) -> list[float]:
    """||y_q - y|| / ||y|| per token (rows)."""
    y_q, y = y_q.float().reshape(-1, y.shape[-1]), y.float().reshape(-1, y.shape[-1])
    return ((y_q - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-30)).tolist()


def _tiny_model(family: str, seed: int):
    """A random-weight bf16 model of ``family`` with eager experts, in memory."""
    import torch

    from flashmoe.tools.tiny_models import tiny_model

    model = tiny_model(family, seed, **TINY_SHAPE)
    if model.config._experts_implementation != "eager":
        raise RuntimeError(f"transformers did not select the eager experts implementation "
                           f"(got {model.config._experts_implementation!r})")
    return model.to(torch.bfloat16).eval()


def family_rows(family: str, seed: int = 0, prompts: int = PROMPTS,
                positions: int = POSITIONS, group_size: int | None = None) -> list[dict]:
    """The native, int8 and int4 rows of one tiny model family."""
    import torch

    from common.model_families import FAMILIES
    from common.quant import GROUP_SIZE
    from services.inference_worker.quantized import quantize_experts_module

    adapter = FAMILIES[family]
    native = _tiny_model(family, seed)
    ids = torch.randint(2, native.config.vocab_size, (prompts, positions),
                        generator=torch.Generator().manual_seed(seed))
    native_experts = dict(adapter.experts_modules(native))

    def run(model, on_block):
        handles = [module.register_forward_hook(
            lambda module, args, kwargs, out, layer=layer: on_block(layer, args, kwargs, out),
            with_kwargs=True) for layer, module in adapter.experts_modules(model)]
        try:
            with torch.no_grad():
                return model(input_ids=ids).logits.float().reshape(-1, native.config.vocab_size)
        finally:
            for handle in handles:
                handle.remove()

    native_out: dict[int, torch.Tensor] = {}
    logits = run(native, lambda layer, args, kwargs, out: native_out.__setitem__(layer, out))
    top2 = logits.topk(2, dim=-1).values
    ties = int((top2[:, 0] == top2[:, 1]).sum())
    log_p = torch.log_softmax(logits, dim=-1)
    rows = []
    for precision in PRECISIONS:
        model = copy.deepcopy(native)  # the native row too: a rerun, compared bit for bit
        if precision != "native":
            for _, module in adapter.experts_modules(model):
                quantize_experts_module(module, precision, group_size or GROUP_SIZE)
        own, carried = [], []

        def on_block(layer, args, kwargs, out):
            with torch.no_grad():
                reference = native_experts[layer](*args, **kwargs)
            own.extend(rel_errors(out, reference))
            carried.extend(rel_errors(out, native_out[layer]))

        log_q = torch.log_softmax(run(model, on_block), dim=-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
        agree = (log_p.argmax(dim=-1) == log_q.argmax(dim=-1)).float()
        rows.append({"family": family, "precision": precision,
                     "mean_rel_error": float(np.mean(own)),
                     "carried_rel_error": float(np.mean(carried)),
                     "kl": float(kl.mean()), "top1_agreement": float(agree.mean()),
                     "ties": ties, "positions": int(logits.shape[0])})
    return rows


def shape_rows(shape_name: str = "gpt-oss-20b", scale: float = 0.21, seed: int = 0,
               layers: int = SHAPE_LAYERS, experts: int = SHAPE_EXPERTS,
               tokens: int = SHAPE_TOKENS, group_size: int | None = None) -> list[dict]:
    """The native, int8 and int4 rows of one MoE block in a synthetic store's real shape."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.model_families import SYNTH_SHAPES, family_for_config
    from common.quant import GROUP_SIZE
    from flashmoe.tools.synth_store import POOL_VALUES, _bf16_pool, scaled_intermediate
    from flashmoe.tools.tiny_models import tiny_config
    from services.inference_worker.quantized import quantize_experts_module

    if shape_name not in SYNTH_SHAPES:
        raise ValueError(f"no synthetic shape {shape_name!r} (choices: "
                         f"{', '.join(SYNTH_SHAPES)})")
    shape = SYNTH_SHAPES[shape_name]
    adapter = family_for_config({"model_type": shape.model_type})
    intermediate = scaled_intermediate(shape, scale)
    experts = min(experts, shape.experts)
    config = tiny_config(adapter.name, layers=1, experts=experts, top_k=shape.top_k,
                         hidden=shape.hidden, expert_intermediate=intermediate)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 experts_implementation="eager")
    (_, module), = adapter.experts_modules(model)
    rng = np.random.default_rng(seed)
    pool = _bf16_pool(rng)
    pool = np.concatenate([pool, pool])  # any window of up to the pool's size is contiguous
    generator = torch.Generator().manual_seed(seed)
    errors: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for _ in range(layers):
        for name, parameter in list(module.named_parameters(recurse=False)):
            per_expert = int(np.prod(parameter.shape[1:]))
            values = np.stack([pool[start:start + per_expert] for start in
                               rng.integers(0, POOL_VALUES, size=experts)])
            weights = torch.from_numpy(values).view(torch.bfloat16).view(parameter.shape)
            setattr(module, name, torch.nn.Parameter(weights, requires_grad=False))
        hidden = torch.randn(tokens, shape.hidden, generator=generator).to(torch.bfloat16)
        logits = torch.randn(tokens, experts, generator=generator)
        top, index = logits.topk(min(shape.top_k, experts), dim=-1)
        weights = torch.softmax(top, dim=-1).to(torch.bfloat16)
        with torch.no_grad():
            reference = module(hidden, index, weights)
            for precision in PRECISIONS:
                quantized = module
                if precision != "native":
                    quantized = copy.deepcopy(module)
                    quantize_experts_module(quantized, precision, group_size or GROUP_SIZE)
                errors[precision] += rel_errors(quantized(hidden, index, weights), reference)
    return [{"family": shape.name, "precision": p, "mean_rel_error": float(np.mean(errors[p])),
             "carried_rel_error": None, "kl": None, "top1_agreement": None, "ties": None,
             "intermediate": intermediate, "tokens": tokens * layers}
            for p in PRECISIONS]


def precision_report(budget: float, shape: str = "gpt-oss-20b", scale: float = 0.21,
                     seed: int = 0, families: tuple[str, ...] = TINY_FAMILIES,
                     quick: bool = False) -> dict:
    """The whole report; ``quick``: one short prompt and one layer of the real shape."""
    from common.quant import GROUP_SIZE
    from services.inference_worker.quantized import kernel, why_not

    start = time.monotonic()
    sizes = dict(prompts=1, positions=8) if quick else {}
    results = [row for family in families for row in family_rows(family, seed, **sizes)]
    results += shape_rows(shape, scale, seed, **(dict(layers=1, tokens=4) if quick else {}))
    return {"budget_fraction": budget, "group_size": GROUP_SIZE, "shape": shape,
            "scale": scale, "seed": seed, "kernel": kernel(), "kernel_why_not": why_not(),
            "seconds": round(time.monotonic() - start, 1), "results": results}


# (JSON key, heading, format) of the table's number columns
COLUMNS = (("mean_rel_error", "rel.err", "8.2%"), ("carried_rel_error", "carried", "8.2%"),
           ("kl", "KL", "10.2e"), ("top1_agreement", "top-1", "6.3f"), ("ties", "ties", "4d"))


def format_table(doc: dict) -> str:
    widths = [int(fmt[:-1].split(".")[0]) for _, _, fmt in COLUMNS]
    lines = [f"{'family':13s} {'precision':9s} " + " ".join(
        f"{head:>{w}s}" for (_, head, _), w in zip(COLUMNS, widths))]
    for r in doc["results"]:
        lines.append(f"{r['family']:13s} {r['precision']:9s} " + " ".join(
            f"{'-':>{w}s}" if r[key] is None else format(r[key], fmt)
            for (key, _, fmt), w in zip(COLUMNS, widths)))
    lines.append(f"group size {doc['group_size']}, kernel {doc['kernel']}"
                 f"{' (' + doc['kernel_why_not'] + ')' if doc['kernel_why_not'] else ''}, "
                 f"{doc['seconds']} s")
    return "\n".join(lines)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a budget is a fraction in (0, 1], got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=_fraction, default=0.25,
                   help="the RAM budget (fraction of all experts' bytes) this report goes "
                        "with; recorded only: the errors do not depend on it")
    from common.model_families import SYNTH_SHAPES

    p.add_argument("--shape", default="gpt-oss-20b", choices=tuple(SYNTH_SHAPES),
                   help="the real-shape rows' synthetic shape (flashmoe synth-store --shape)")
    p.add_argument("--scale", type=float, default=0.21,
                   help="its expert intermediate multiplier (synth-store --scale)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="one short prompt per family and one layer of the real shape (tests)")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    doc = precision_report(args.budget, args.shape, args.scale, args.seed, quick=args.quick)
    print(format_table(doc))
    save(args, doc)
    return 0
