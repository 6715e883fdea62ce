"""The inference worker computes exactly what transformers computes.

Per family, a tiny random-weight model (transformers' own classes) is converted to a store and
served by a real cache-manager process whose arena holds far fewer experts than the model has
(every step evicts). The worker (``ModelRunner``, experts from the arena) decodes greedily;
the reference is the same checkpoint fully in RAM through transformers' own forward with
``experts_implementation="eager"`` (transformers' grouped/batched expert implementations
differ from eager in the last bits, so eager is the one the worker reproduces). Logits must
be bit-identical (``torch.equal``) at every step, the prompt's prefill included.
"""

import json
import math
import time
from collections import Counter

import numpy as np
import pytest
import torch
import zmq
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.arena import Arena
from common.bus import Subscriber
from common.cache_client import CacheClient
from common.config import FlashMoEConfig
from common.model_families import FAMILIES, GPT_OSS_PROJECTIONS, gpt_oss_expert_shapes
from common.protocol import AccessEvent, LearningMessage
from common.safetensors_io import read_header
from common.store import NON_EXPERT_NAME, ExpertStore
from flashmoe.tools.convert import convert_checkpoint
from flashmoe.tools.tiny_models import build_tiny_model
from services.cache_manager.io_engine import PreadEngine
from services.inference_worker.generate import arena_fetch, generate
from services.inference_worker.model_runner import WEIGHT_ALIGN, ArenaExperts, ModelRunner
from tests.support.stores import TEST_BLOCK_SIZE, TEST_PARALLELISM

LAYERS, EXPERTS, TOP_K = 3, 16, 4
CAPACITY = 2 * TOP_K + 2  # 10 slots for 48 experts: evictions all the time
STEPS = 32
PROMPT = "FlashMoE runs Mixture-of-Experts models whose experts live on SSD."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(checkpoint folder, store folder) per (family, dtype), built on first use."""
    root = tmp_path_factory.mktemp("worker_exact")
    made = {}

    def get(family: str, dtype: str = "float32"):
        if (family, dtype) not in made:
            ckpt = build_tiny_model(family, root / f"{family}-{dtype}" / "hf", dtype=dtype,
                                    layers=LAYERS, experts=EXPERTS, top_k=TOP_K, hidden=64,
                                    expert_intermediate=64)
            store = root / f"{family}-{dtype}" / "store"
            convert_checkpoint(ckpt, store, block_size=TEST_BLOCK_SIZE,
                               parallelism=TEST_PARALLELISM, show_progress=False)
            made[(family, dtype)] = (ckpt, store)
        return made[(family, dtype)]

    return get


def reference_greedy(ckpt, family, dtype, prompt_ids, steps):
    """Per step (prefill, then ``steps`` greedy decode steps with its KV cache) of
    transformers' own forward with eager experts: the last position's logits, and each MoE
    layer's routing (expert ids, weights) as its experts module received it."""
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype,
                                                 experts_implementation="eager")
    assert model.config._experts_implementation == "eager"
    # Every weight in an allocation of its own, as the worker keeps them: a float32 product
    # rounds differently in the last bits on a weight that is not 16-byte aligned, and
    # safetensors leaves loaded tensors wherever they start in the file (WEIGHT_ALIGN).
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.data_ptr() % WEIGHT_ALIGN:
                parameter.data = parameter.data.clone()
    routing = {}
    for layer, module in FAMILIES[family].experts_modules(model):
        module.register_forward_pre_hook(
            lambda mod, args, layer=layer: routing.__setitem__(
                layer, (args[1][-1].tolist(), args[2][-1].float().tolist())))
    out_steps, cache, ids = [], None, prompt_ids
    with torch.inference_mode():
        for _ in range(steps + 1):
            out = model(input_ids=torch.tensor([ids]), use_cache=True, cache=cache)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            logits = out.logits[0, -1].clone()
            out_steps.append((logits, [routing[layer] for layer in sorted(routing)]))
            ids = [int(logits.argmax())]
    return out_steps


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_worker_logits_are_bit_identical_to_transformers_eager(family, dtype, models,
                                                               start_manager):
    ckpt, store = models(family, dtype)
    prompt_ids = AutoTokenizer.from_pretrained(str(store))(PROMPT)["input_ids"]
    assert len(prompt_ids) > 8
    want = reference_greedy(ckpt, family, DTYPES[dtype], prompt_ids, STEPS)
    manager = start_manager(store, f"cache.capacity_experts={CAPACITY}")
    with CacheClient(manager.endpoint) as client:
        arena = client.arena
        fetched_from, requests = [], []
        fetch = arena_fetch(client)

        def watched(layer, experts, release, token, weights=()):
            params = fetch(layer, experts, release, token, weights)
            fetched_from.extend(t.data_ptr() for p in params for t in p.values())
            requests.append((list(experts), list(weights)))
            return params

        runner = ModelRunner(store, watched)
        # No expert parameter exists in RAM: every experts module is an ArenaExperts without
        # parameters, and the model's parameters are exactly the store's non-expert tensors.
        experts_modules = [m for m in runner.model.modules() if isinstance(m, ArenaExperts)]
        assert len(experts_modules) == LAYERS
        assert all(not list(m.parameters()) for m in experts_modules)
        non_expert = read_header(store / NON_EXPERT_NAME)
        assert sum(p.numel() for p in runner.model.parameters()) == \
            sum(math.prod(r.shape) for r in non_expert.values())

        got = [runner.prefill(prompt_ids)]
        for _ in range(STEPS):
            token = int(got[-1].logits.argmax())
            requests.clear()
            got.append(runner.decode(token, f"<{token}>"))
            # a decode step's requests carry its router's choice and weights, layer by layer
            assert requests == list(zip(got[-1].experts, got[-1].probs))
        stats = client.stats()
        mapping_start = np.frombuffer(arena.mmap, dtype=np.uint8).ctypes.data
        arena_bytes = arena.slot_bytes * arena.n_slots
    assert len(got) == len(want) == STEPS + 1
    for step, (mine, (logits, routing)) in enumerate(zip(got, want)):
        assert mine.logits.dtype == logits.dtype == DTYPES[dtype]
        assert torch.equal(mine.logits, logits), (family, dtype, step)
        assert list(zip(mine.experts, mine.probs)) == [tuple(r) for r in routing]
        assert [len(set(row)) for row in mine.experts] == [TOP_K] * LAYERS
    assert [int(s.logits.argmax()) for s in got] == [int(w[0].argmax()) for w in want]
    # Computed straight from the arena: every fetched tensor lies inside the shared mapping.
    assert fetched_from and all(mapping_start <= p < mapping_start + arena_bytes
                                for p in fetched_from)
    assert stats["n_evict"] > 0 and stats["n_miss"] > LAYERS * EXPERTS // 2
    assert stats["n_checksum_error"] == 0


def test_generate_streams_tokens_publishes_events_and_returns_stats(models, start_manager,
                                                                   tmp_path):
    ckpt, store = models("qwen3_moe", "bfloat16")
    manager = start_manager(store, f"cache.capacity_experts={CAPACITY}")
    events = f"ipc://{tmp_path}/events.sock"
    ctx = zmq.Context()
    subscriber = Subscriber(ctx, FlashMoEConfig(), [events], LearningMessage, Counter(), "test")
    pieces, seen_at = [], []
    try:
        result = generate(store, PROMPT, 12, manager.endpoint, events=events,
                          on_token=lambda piece: (pieces.append(piece),
                                                  seen_at.append(time.monotonic())),
                          settle_s=0.3)
        time.sleep(0.2)
        received = [m for m in subscriber.drain() if isinstance(m, AccessEvent)]
    finally:
        subscriber.close()
        ctx.term()
    tokens = result["token_ids"]
    assert 1 <= len(tokens) <= 12 and len(pieces) == len(tokens)
    assert "".join(pieces) == result["text"]
    assert seen_at == sorted(seen_at)
    # The same greedy tokens as transformers' own generation of the whole checkpoint.
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), experts_implementation="eager")
    with torch.inference_mode():
        reference = model.generate(torch.tensor([result["prompt_ids"]]), max_new_tokens=12,
                                   do_sample=False, eos_token_id=model.config.eos_token_id)
    assert tokens == reference[0, len(result["prompt_ids"]):].tolist()
    stats = result["stats"]
    assert stats["n_hit"] + stats["n_miss"] >= LAYERS * TOP_K * len(tokens)
    assert stats["pinned"] == 0 and stats["n_evict"] > 0
    # One AccessEvent per prompt position (marked prefill), then one per decode step, in
    # order, the last one closing the sequence.
    n = len(result["prompt_ids"])
    assert [e.position for e in received] == list(range(n + len(tokens) - 1))
    assert [e.prefill for e in received] == [True] * n + [False] * (len(tokens) - 1)
    assert all(len(e.experts) == LAYERS and len(e.experts[0]) == TOP_K for e in received)
    assert received[-1].next_token == "" and all(e.next_token for e in received[:-1])


def test_convert_splits_gpt_oss_fused_experts_into_the_checkpoints_bytes(models, tmp_path):
    ckpt, store_path = models("gpt_oss", "bfloat16")
    store = ExpertStore.open(store_path)
    m = store.manifest
    assert m.model_family == "gpt_oss" and m.top_k == TOP_K
    assert sorted(store.keys()) == [(l, e) for l in range(LAYERS) for e in range(EXPERTS)]
    fused = {}
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            if ".mlp.experts." in key:
                fused[key] = f.get_tensor(key)
    arena = Arena.create(1, m.slot_bytes)
    engine = PreadEngine(arena.mmap, arena.slot_bytes, 1, store.stripe_paths, depth=2)
    shapes = gpt_oss_expert_shapes(64, 64)
    try:
        for layer, expert in store.keys():
            entry = store.expert(layer, expert)
            assert [t.name for t in entry.tensors] == list(GPT_OSS_PROJECTIONS)
            ops = store.read_ops(layer, expert, slot=0)
            engine.read(ops)
            store.verify_expert_bytes(layer, expert, arena.slot(0))
            views = arena.torch_views(0, entry)
            for t in entry.tensors:
                source = f"model.layers.{layer}.mlp.experts.{t.name}"
                assert t.key == f"{source}[{expert}]" and t.shape == shapes[t.name]
                want = fused[source][expert]
                assert views[t.name].dtype == want.dtype == torch.bfloat16
                assert torch.equal(views[t.name].view(torch.int16), want.view(torch.int16))
            del views
    finally:
        engine.close()
        arena.close()
    # The non-expert weights hold no expert tensor; the tokenizer came along.
    assert not [k for k in read_header(store_path / NON_EXPERT_NAME) if ".experts." in k]
    assert (store_path / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()
    assert json.loads((store_path / "config.json").read_text())["model_type"] == "gpt_oss"
