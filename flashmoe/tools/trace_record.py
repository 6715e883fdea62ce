"""`flashmoe trace record`: record a real transformers MoE model's router decisions.

Forward hooks on every MoE layer's router capture the experts it selects. Generation is greedy
with a KV cache: the prompt's prefill pass is not recorded (as in the shared traces), then each
decode step feeds the previously generated token and records one row: the top-k experts of
every MoE layer for that token, in the router's own order, with their routing weights. Stops
after ``max_new_tokens`` rows or at the model's end-of-sequence token.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np

from common.model_families import UnsupportedModelError, family_for_config
from common.traces import Trace, TraceError, save_trace


def _topk_from_router_output(output, top_k: int):
    """(expert ids, weights) of the last position from a router's output.

    transformers 5 routers return (logits, top-k weights, top-k indices); older ones return the
    logits alone, from which the softmax top-k is taken."""
    import torch

    if isinstance(output, tuple):
        indices = next((t for t in output if torch.is_tensor(t) and not t.is_floating_point()), None)
        if indices is not None:
            weights = next(t for t in output[1:] if torch.is_tensor(t) and t.shape == indices.shape
                           and t.is_floating_point())
            return indices.reshape(-1, indices.shape[-1])[-1], weights.reshape(-1, indices.shape[-1])[-1]
        output = output[0]
    probs = torch.softmax(output.reshape(-1, output.shape[-1])[-1].float(), dim=-1)
    weights, indices = torch.topk(probs, top_k)
    return indices, weights / weights.sum()


def read_prompts(path: str | Path, tokenizer_dir: Path) -> list[tuple[list[int], dict]]:
    prompts, tokenizer = [], None
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise TraceError(f"{path}:{n}: not JSON: {exc}") from None
        if "input_ids" in item:
            ids = [int(i) for i in item["input_ids"]]
        elif "text" in item:
            if tokenizer is None:
                from transformers import AutoTokenizer

                try:
                    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
                except (OSError, ValueError) as exc:
                    raise TraceError(f"{path}:{n}: a text prompt needs a tokenizer in "
                                     f"{tokenizer_dir}: {exc}") from None
            ids = tokenizer(item["text"])["input_ids"]
        else:
            raise TraceError(f"{path}:{n}: expected \"text\" or \"input_ids\"")
        if not ids:
            raise TraceError(f"{path}:{n}: empty prompt")
        prompts.append((ids, {k: v for k, v in item.items() if k not in ("input_ids",)}))
    if not prompts:
        raise TraceError(f"{path}: no prompts")
    return prompts


def record_trace(model_dir: str | Path, prompts_file: str | Path, out: str | Path,
                 max_new_tokens: int = 64) -> Trace:
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise TraceError(f"{model_dir}: no config.json; not a Hugging Face model folder")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
    model.eval()
    config = model.config
    try:
        family = family_for_config(config.to_dict())
    except UnsupportedModelError as exc:
        raise TraceError(f"{model_dir}: {exc}") from None
    top_k = int(getattr(config, family.top_k_key, 0))
    num_experts = int(getattr(config, family.num_experts_key, 0))
    routers = family.routers(model)
    if not routers or not top_k or not num_experts:
        raise TraceError(f"{model_dir}: no MoE routers found (model_type {config.model_type!r})")
    # transformers >= 5.x names the KV cache argument and output "cache"; older, "past_key_values".
    cache_name = ("cache" if "cache" in inspect.signature(model.forward).parameters
                  else "past_key_values")
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    step: dict[int, tuple] = {}
    hooks = [module.register_forward_hook(
        lambda mod, args, output, layer=layer: step.__setitem__(
            layer, _topk_from_router_output(output, top_k)))
        for layer, module in routers]
    rows, prob_rows, offsets, sequences = [], [], [0], []
    try:
        with torch.inference_mode():
            for ids, info in read_prompts(prompts_file, model_dir):
                result = model(torch.tensor([ids]), use_cache=True)
                token = int(result.logits[0, -1].argmax())
                generated = [token]
                for _ in range(max_new_tokens):
                    if token in eos_ids:
                        break
                    step.clear()
                    result = model(torch.tensor([[token]]), use_cache=True,
                                   **{cache_name: getattr(result, cache_name)})
                    rows.append([step[layer][0].tolist() for layer, _ in routers])
                    prob_rows.append([step[layer][1].float().tolist() for layer, _ in routers])
                    token = int(result.logits[0, -1].argmax())
                    generated.append(token)
                offsets.append(len(rows))
                sequences.append({**info, "prompt_tokens": len(ids), "generated_ids": generated,
                                  "n_decode_tokens": offsets[-1] - offsets[-2]})
    finally:
        for hook in hooks:
            hook.remove()
    experts = np.asarray(rows, dtype=np.int16).reshape(len(rows), len(routers), top_k)
    probs = np.asarray(prob_rows, dtype=np.float16).reshape(experts.shape)
    trace = Trace(Path(out).name, experts, np.asarray(offsets, dtype=np.int64), num_experts,
                  str(model_dir), probs, sequences)
    save_trace(trace, out, model_type=config.model_type, moe_layers=[l for l, _ in routers])
    return trace
