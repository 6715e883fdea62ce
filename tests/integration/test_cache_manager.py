"""The cache manager as a real process, workers as real processes, over real ipc sockets."""

import json
import multiprocessing as mp
import random

import numpy as np
import pytest
import torch

from common.bus import policies
from common.cache_client import CacheClient
from common.config import load_config
from common.store import ExpertStore
from tests.support.stores import expected_expert_tensors
from tests.support.uring import uring_available

URING_OK, URING_WHY = uring_available()


def worker_main(endpoint, checkpoint, store_path, seed, rounds, out):
    """Acquire random top-2 sets and compare every tensor with the checkpoint."""
    rng = random.Random(seed)
    store = ExpertStore.open(store_path)
    expected = {key: expected_expert_tensors(checkpoint, store, *key) for key in store.keys()}
    bad = 0
    with CacheClient(endpoint, name=f"worker{seed}") as client:
        layers = store.manifest.moe_layers
        for _ in range(rounds):
            layer = rng.choice(layers)
            experts = rng.sample(range(store.manifest.num_experts), 2)
            others = [other for other in layers if other != layer]
            for expert, tensors in zip(experts, client.acquire_tensors(layer, experts, others)):
                for name, tensor in tensors.items():
                    if not torch.equal(tensor.view(torch.int16),
                                       expected[(layer, expert)][name].view(torch.int16)):
                        bad += 1
            del tensors
        out.put((seed, bad, client.engine))


@pytest.mark.parametrize("engine", ["pread", "uring"])
def test_two_workers_concurrently_get_correct_bytes(engine, tiny_store, tiny_checkpoints,
                                                    start_manager):
    if engine == "uring" and not URING_OK:
        pytest.skip(f"io_uring helper unavailable: {URING_WHY}")
    # 6 slots for 16 experts: constant eviction while both workers hold 2 pins each.
    manager = start_manager(tiny_store, f"io.engine={engine}", "cache.capacity_experts=6")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    workers = [ctx.Process(target=worker_main, args=(manager.endpoint,
                                                     tiny_checkpoints["qwen3_moe"],
                                                     tiny_store, seed, 150, out))
               for seed in (1, 2)]
    for w in workers:
        w.start()
    results = [out.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    assert sorted(r[0] for r in results) == [1, 2]
    assert all(r[1] == 0 for r in results), results
    assert all(r[2] == engine for r in results)
    with CacheClient(manager.endpoint, name="observer") as client:
        stats = client.stats()
    assert stats["engine"] == engine and stats["n_miss"] > 16 and stats["n_hit"] > 0
    assert stats["n_evict"] > 0 and stats["n_byte_read"] > 0 and stats["read_p99_us"] > 0
    # The two workers exited: only the observer is a live worker, and nothing stays pinned.
    assert stats["n_checksum_error"] == 0 and stats["workers"] == 1 and stats["pinned"] == 0


def test_stats_release_and_zero_copy_views(tiny_store, start_manager):
    manager = start_manager(tiny_store, "io.engine=auto")
    with CacheClient(manager.endpoint) as client:
        first = client.acquire(0, [1, 2])
        again = client.acquire(0, [2, 1])
        assert again == first[::-1]
        views = client.acquire_tensors(0, [3])[0]
        assert views["gate_proj"].dtype == torch.bfloat16
        base = np.frombuffer(client.arena.mmap, dtype=np.uint8).ctypes.data
        size = client.arena.slot_bytes * client.arena.n_slots
        for tensor in views.values():  # views into the shared arena, not copies
            assert base <= tensor.data_ptr() < base + size
        client.release()
        stats = client.stats()
        assert stats["n_hit"] == 2 and stats["n_miss"] == 3 and stats["resident"] == 3
        assert stats["engine"] in ("uring", "pread")
        assert stats["engine"] == ("uring" if URING_OK else "pread")
        del views


def test_worker_config_digest_reaches_the_manager(tiny_store, start_manager):
    manager = start_manager(tiny_store)
    config = load_config(env={}, overrides=[f"store.path={tiny_store}"])
    with CacheClient(manager.endpoint, config=config) as client:
        assert client.ready.n_slots == 64 and client.ready.slot_bytes % 4096 == 0
        assert client.ready.config_digests == config.section_digests()


@pytest.mark.parametrize("policy", ["arc", "s3fifo", "lirs", "car", "sieve", "lfu", "fifo"])
def test_live_manager_runs_any_registered_policy(policy, tiny_store, start_manager):
    manager = start_manager(tiny_store, f"cache.policy={policy}", "cache.capacity_experts=5")
    with CacheClient(manager.endpoint) as client:
        rng = random.Random(0)
        for _ in range(60):
            layer = rng.choice([0, 1])
            client.acquire(layer, rng.sample(range(8), 2), release_layers=[1 - layer])
        stats = client.stats()
    assert stats["policy"] == policy and stats["n_evict"] > 0
    assert stats["n_hit"] + stats["n_miss"] == 120 and stats["resident"] <= 5


def test_manager_gives_the_policies_it_can_run_live(tiny_store, start_manager):
    manager = start_manager(tiny_store, "cache.policy=arc")
    with CacheClient(manager.endpoint):  # the control socket answers once a worker is served
        rep = policies(manager.control)
    assert rep.policy == "arc" and {"lru", "arc", "flashmoe"} <= set(rep.choices)
    assert "belady" not in rep.choices  # needs the future: the simulator's alone


@pytest.mark.parametrize("policy, words", [("nope", "is not allowed; choices: arc"),
                                           ("belady", "needs future knowledge")])
def test_bad_policy_fails_at_start_naming_the_setting(policy, words, tiny_store, start_manager):
    manager = start_manager(tiny_store, f"cache.policy={policy}")
    assert manager.proc.wait(30) != 0
    log = manager.log()
    assert "cache.policy" in log and words in log


def test_policy_params_reach_the_policy_and_bad_ones_fail_at_start(tiny_store, start_manager):
    bad = start_manager(tiny_store, "cache.policy=s3fifo", 'cache.policy_params={"nope": 1}')
    assert bad.proc.wait(30) != 0
    assert "cache.policy_params" in bad.log() and "nope" in bad.log()
    out_of_range = start_manager(tiny_store, "cache.policy=s3fifo",
                                 'cache.policy_params={"small_ratio": 2.0}')
    assert out_of_range.proc.wait(30) != 0 and "small_ratio" in out_of_range.log()
    good = start_manager(tiny_store, "cache.policy=s3fifo", "cache.capacity_experts=5",
                         'cache.policy_params={"small_ratio": 0.4}')
    with CacheClient(good.endpoint) as client:
        for expert in range(8):
            client.acquire(0, [expert])
        stats = client.stats()
    assert stats["policy"] == "s3fifo"
    assert json.loads(stats["policy_params"])["small_ratio"] == 0.4
