"""Random-weight MoE checkpoints of real transformers model classes, built from configs.

Nothing is downloaded: the model classes are transformers' own, the weights are random, and
``save_pretrained`` writes the same safetensors keys a real checkpoint has (per-expert keys for
Qwen3-MoE, OLMoE and Mixtral, a layer's experts fused for GPT-OSS). Each model is saved with a
small byte-level BPE tokenizer trained here, with the ``tokenizers`` library, on this
repository's own text, and a chat template, so that text generation and chat work end to end.
Tests use these; real checkpoints are a user's local folder.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from common.model_families import FAMILIES

# transformers' (config, model) class names of each family
FAMILY_CLASSES = {name: family.transformers_classes for name, family in FAMILIES.items()}
BOS, EOS = "<|bos|>", "<|eos|>"  # ids 0 and 1, as in every tiny config
ROOT = Path(__file__).resolve().parents[2]
# The tokenizer's training text: this repository's README, then the text of its common/
# modules (a fixed, local corpus: the same checkout always gives the same tokenizer).
CORPUS = (ROOT / "README.md", *sorted((ROOT / "common").glob("*.py")))
# ChatML's layout on the tokenizer's own special tokens: each message is BOS, its role, a
# newline, its text (a string, or OpenAI-style parts whose text parts are joined) and EOS; with
# add_generation_prompt the assistant's header follows, so that generation ends at EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ bos_token + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endfor %}{% endif %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}")


def tiny_config(family: str, layers: int = 2, experts: int = 8, top_k: int = 2,
                hidden: int = 64, expert_intermediate: int = 64, vocab: int = 512):
    import transformers

    if family not in FAMILY_CLASSES:
        raise ValueError(f"unknown family {family!r}; choices: {', '.join(FAMILY_CLASSES)}")
    config_cls = getattr(transformers, FAMILY_CLASSES[family][0])
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=max(hidden // 4, 8),
                  num_experts_per_tok=top_k, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    sizes = {FAMILIES[family].num_experts_key: experts, "intermediate_size": expert_intermediate}
    if family == "gpt_oss":  # its YaRN rope wants the default (long) context length
        return config_cls(**common, **sizes)
    common["max_position_embeddings"] = 512
    if family == "qwen3_moe":  # every layer sparse, at the experts' own intermediate size
        sizes.update(moe_intermediate_size=expert_intermediate, decoder_sparse_step=1,
                     mlp_only_layers=[])
    return config_cls(**common, **sizes)


@lru_cache(maxsize=4)
def _tokenizer_json(vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = [path.read_text(errors="replace") for path in CORPUS if path.is_file()]
    tokenizer.train_from_iterator(texts, trainer)
    got = tokenizer.get_vocab_size()
    if got != vocab:
        advice = ("a byte-level tokenizer needs at least 256 + its special tokens" if got > vocab
                  else "its corpus is too small for more; choose a smaller vocabulary")
        raise ValueError(f"the tiny tokenizer has {got} tokens, not {vocab}: {advice}")
    return tokenizer.to_str()


def train_tokenizer(vocab: int):
    """A byte-level BPE tokenizer of exactly ``vocab`` tokens (BOS and EOS first) trained on
    CORPUS, with CHAT_TEMPLATE, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab)),
                                   bos_token=BOS, eos_token=EOS, chat_template=CHAT_TEMPLATE)


def tiny_model(family: str, seed: int = 0, **shape):
    """A random-weight float32 model of ``family`` in memory, its experts transformers' eager
    code (``experts_implementation="eager"``; the weights are those of the class built
    plainly)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **shape)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with torch.no_grad():
        # transformers starts expert biases (GPT-OSS) at zero; random ones test their path
        for name, parameter in model.named_parameters():
            if ".experts." in name and name.endswith("_bias"):
                parameter.normal_(0.0, config.initializer_range)
    return model


def build_tiny_model(family: str, out_dir: str | Path, seed: int = 0, dtype: str = "bfloat16",
                     **shape) -> Path:
    """Save a random-weight model of ``family`` (bf16 by default) and its tokenizer to
    ``out_dir``."""
    import torch

    model = tiny_model(family, seed, **shape).to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    train_tokenizer(model.config.vocab_size).save_pretrained(out_dir)
    return out_dir
