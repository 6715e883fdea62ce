"""Random-weight MoE checkpoints of real transformers model classes, built from configs.

Nothing is downloaded: the model classes are transformers' own, the weights are random, and
``save_pretrained`` writes the same per-expert safetensors keys a real checkpoint has. Tests
and the demo use these; real checkpoints are a user's local folder.
"""

from __future__ import annotations

from pathlib import Path

FAMILY_CLASSES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}


def tiny_config(family: str, layers: int = 2, experts: int = 8, top_k: int = 2,
                hidden: int = 64, expert_intermediate: int = 64, vocab: int = 256):
    import transformers

    if family not in FAMILY_CLASSES:
        raise ValueError(f"unknown family {family!r}; choices: {', '.join(FAMILY_CLASSES)}")
    config_cls = getattr(transformers, FAMILY_CLASSES[family][0])
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=max(hidden // 4, 8),
                  num_experts_per_tok=top_k, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, pad_token_id=None)
    if family == "qwen3_moe":
        return config_cls(**common, num_experts=experts, moe_intermediate_size=expert_intermediate,
                          intermediate_size=expert_intermediate, decoder_sparse_step=1,
                          mlp_only_layers=[])
    if family == "olmoe":
        return config_cls(**common, num_experts=experts, intermediate_size=expert_intermediate)
    return config_cls(**common, num_local_experts=experts, intermediate_size=expert_intermediate)


def build_tiny_model(family: str, out_dir: str | Path, seed: int = 0, dtype: str = "bfloat16",
                     **shape) -> Path:
    """Save a random-weight model of ``family`` (bf16 by default) to ``out_dir``."""
    import torch
    import transformers

    config = tiny_config(family, **shape)
    torch.manual_seed(seed)
    model_cls = getattr(transformers, FAMILY_CLASSES[family][1])
    with torch.device("cpu"):
        model = model_cls(config).to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir
