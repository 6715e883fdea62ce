"""The serving engine in-process, over a real cache manager: sequences decoded together get
exactly the logits they get alone (their experts fetched once per layer for all of them, in
requests smaller than their union), and a failed fetch fails that step's requests, not the
engine."""

from __future__ import annotations

import pytest
import torch

from common.cache_client import CacheClient, ExpertLoadError
from services.inference_worker.engine import IO_ERROR_STRIKES, Engine, Request, SamplingParams
from services.inference_worker.generate import arena_fetch, load_tokenizer
from services.inference_worker.model_runner import ModelRunner
from tests.support.stores import flip_byte

PROMPTS = ["FlashMoE keeps", "The cache manager", "Experts live on SSD in a striped store"]


def run(engine: Engine, prompts: list[str], tokenizer, n: int = 8) -> list[dict]:
    """Submit every prompt at once, turn the loop until all are done."""
    results = [{"pieces": []} for _ in prompts]

    def emit_for(i):
        def emit(kind, payload):
            if kind == "text":
                results[i]["pieces"].append(payload)
            else:
                results[i][kind] = payload
        return emit

    for i, p in enumerate(prompts):
        engine.submit(Request(tokenizer(p)["input_ids"],
                              SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                              emit_for(i)))
    while not all("done" in r or "error" in r for r in results):
        engine.turn()
    engine.turn()  # idle: the engine lets go of its pins
    return results


@pytest.fixture
def engine_parts(tiny_store, start_manager):
    yield from parts_over(tiny_store, start_manager)


def parts_over(store, start_manager):
    """A client of a real cache manager of ``store`` (6 slots), a runner fetching through it
    with every fetch recorded, the tokenizer, and the record."""
    manager = start_manager(store, "cache.capacity_experts=6")
    with CacheClient(manager.endpoint) as client:
        fetches = []
        fetch = arena_fetch(client)

        def watched(layer, experts, release, token, weights=()):
            fetches.append((layer, list(experts)))
            return fetch(layer, experts, release, token, weights)

        yield client, ModelRunner(store, watched), load_tokenizer(store), fetches


def make_engine(client, runner, tokenizer, max_request: int, max_batch: int,
                route_around: int = -1) -> Engine:
    return Engine(runner, tokenizer, max_request, release=client.release, max_batch=max_batch,
                  route_around=route_around)


def test_sequences_together_get_their_solo_answers_with_shared_fetches(engine_parts):
    client, runner, tokenizer, fetches = engine_parts
    alone = [run(make_engine(client, runner, tokenizer, 6, 1), [p], tokenizer)[0]
             for p in PROMPTS]
    fetches_alone = len(fetches)
    fetches.clear()
    engine = make_engine(client, runner, tokenizer, 2, 3)  # requests of 2 < the union
    together = run(engine, PROMPTS, tokenizer)
    assert [r["done"]["token_ids"] for r in together] == [r["done"]["token_ids"] for r in alone]
    assert ["".join(r["pieces"]) for r in together] == ["".join(r["pieces"]) for r in alone]
    assert engine.stats["max_batch"] == 3
    assert all(len(experts) <= 2 for _, experts in fetches)
    # one meeting per layer and step serves all three: fewer requests than alone, even in
    # requests of 2 experts
    assert len(fetches) < fetches_alone
    assert client.stats()["pinned"] == 0  # idle: the engine released its pins


def test_a_failed_fetch_fails_its_step_and_the_engine_goes_on(engine_parts):
    client, runner, tokenizer, _ = engine_parts
    real = runner.fetch
    calls = {"n": 0}

    def flaky(layer, experts, release, token, weights=()):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("a read failed")
        return real(layer, experts, release, token, weights)

    runner.fetch = flaky
    engine = make_engine(client, runner, tokenizer, 6, 3)
    failed = run(engine, PROMPTS, tokenizer)
    assert all("error" in r for r in failed)
    assert engine.stats["requests_failed"] == 3
    ok = run(engine, PROMPTS[:1], tokenizer)
    assert "done" in ok[0] and len(ok[0]["done"]["token_ids"]) == 8


def test_stop_strings_and_seeded_sampling(engine_parts):
    client, runner, tokenizer, _ = engine_parts
    engine = make_engine(client, runner, tokenizer, 6, 2)
    full = "".join(run(engine, PROMPTS[:1], tokenizer, 12)[0]["pieces"])
    stop = full[4:6]
    results = []
    for params in (SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]),
                   SamplingParams(max_tokens=12, temperature=0.8, seed=3),
                   SamplingParams(max_tokens=12, temperature=0.8, seed=3)):
        out = {"pieces": []}
        engine.submit(Request(tokenizer(PROMPTS[0])["input_ids"], params,
                              lambda k, p, out=out: out["pieces"].append(p) if k == "text"
                              else out.__setitem__(k, p)))
        while "done" not in out:
            engine.turn()
        results.append(out)
    assert "".join(results[0]["pieces"]) == full[:full.index(stop)]
    assert results[0]["done"]["finish_reason"] == "stop"
    assert results[1]["done"]["token_ids"] == results[2]["done"]["token_ids"]


def test_a_failed_load_fails_the_request_that_needs_it_and_the_others_go_on(engine_parts):
    """The client's typed ExpertLoadError for an expert only one sequence routed to (a real
    corrupt block would not do here: a tiny random model's prefills route to every expert, so
    every request would need it)."""
    client, runner, tokenizer, _ = engine_parts
    alone = [run(make_engine(client, runner, tokenizer, 6, 1), [p], tokenizer)[0]
             for p in PROMPTS]
    real = runner.fetch
    injected = []

    def failing(layer, experts, release, token, weights=()):
        meet = runner.context().group.meets[layer]
        if not injected and all(len(rows) == 1 for rows in meet.rows):  # a decode step
            chosen = [set(rows[0]) for rows in meet.rows]
            only = [e for e in experts if sum(e in c for c in chosen) == 1]
            if only:
                injected.append(next(i for i, c in enumerate(chosen) if only[0] in c))
                raise ExpertLoadError("checksum", "checksum mismatch", layer, [only[0]])
        return real(layer, experts, release, token)

    runner.fetch = failing
    engine = make_engine(client, runner, tokenizer, 6, 3, route_around=0)
    together = run(engine, PROMPTS, tokenizer)
    assert injected, "no expert routed to by one sequence alone: nothing injected"
    failed = [i for i, r in enumerate(together) if "error" in r]
    assert len(failed) == 1 and isinstance(together[failed[0]]["error"], ExpertLoadError)
    for i, r in enumerate(together):
        if i not in failed:  # the others' answers are their solo ones, nothing of the step lost
            assert r["done"]["token_ids"] == alone[i]["done"]["token_ids"]
    assert engine.stats["requests_failed"] == 1
    assert client.stats()["pinned"] == 0


def test_a_restarted_cache_manager_costs_no_request_and_changes_no_answer(tiny_store, tmp_path):
    """The step in progress when the manager goes is done again on a new connection, its KV
    caches rewound (the step's attention ran before its first MoE layer's fetch failed)."""
    from services.inference_worker.server import Connection
    from tests.support.manager import ManagerHandle

    runtime = tmp_path / "rt"
    runtime.mkdir()
    managers = [ManagerHandle(tiny_store, runtime, ["cache.capacity_experts=6"])]
    try:
        connection = Connection(managers[0].endpoint, None)
        runner = ModelRunner(tiny_store)
        connection.attach(runner)
        tokenizer = load_tokenizer(tiny_store)

        def engine():
            return Engine(runner, tokenizer, 6, release=connection.release, max_batch=3)

        reference = run(engine(), PROMPTS, tokenizer)
        serving = engine()
        results = [{"pieces": []} for _ in PROMPTS]
        for i, p in enumerate(PROMPTS):
            serving.submit(Request(tokenizer(p)["input_ids"],
                                   SamplingParams(max_tokens=8, temperature=0.0,
                                                  ignore_eos=True),
                                   lambda k, x, out=results[i]: out["pieces"].append(x)
                                   if k == "text" else out.__setitem__(k, x)))
        for _ in range(3):  # the prefill and two decode steps
            serving.turn()
        managers[0].stop()  # restarted: a new manager on the same endpoint
        managers.append(ManagerHandle(tiny_store, runtime, ["cache.capacity_experts=6"]))
        while not all("done" in r or "error" in r for r in results):
            serving.turn()
        connection.close()
    finally:
        for manager in managers:
            manager.stop()
    assert [r.get("error") for r in results] == [None] * 3
    assert [r["done"]["token_ids"] for r in results] == \
        [r["done"]["token_ids"] for r in reference]
    assert ["".join(r["pieces"]) for r in results] == ["".join(r["pieces"]) for r in reference]
    assert serving.stats["steps_redone"] >= 1


BAD = (1, 3)  # the expert whose block the bad-block tests damage: layer 1, expert 3


@pytest.fixture
def bad_block_parts(store_copy, start_manager):
    flip_byte(store_copy, *BAD)
    yield from parts_over(store_copy, start_manager)


def test_a_bad_block_costs_the_requests_that_met_it_then_is_routed_around(bad_block_parts):
    """A real bad block (a flipped bit, its checksum failing twice in the cache manager):
    the requests of the step that needed it fail with the typed error; from then on the
    expert is never asked for again, and every request is answered."""
    client, runner, tokenizer, fetches = bad_block_parts
    engine = make_engine(client, runner, tokenizer, 6, 3)
    first = run(engine, PROMPTS, tokenizer)
    failed = [r["error"] for r in first if "error" in r]
    assert failed and all(isinstance(e, ExpertLoadError) and e.code == "checksum" and
                          (e.layer, e.experts) == (BAD[0], [BAD[1]]) for e in failed)
    assert engine.degraded() == [{"layer": BAD[0], "expert": BAD[1]}]
    assert engine.stats["experts_routed_around"] == 1
    checksum_errors = client.stats()["n_checksum_error"]
    fetches.clear()
    second = run(engine, PROMPTS, tokenizer)
    assert all("done" in r and len(r["done"]["token_ids"]) == 8 for r in second)
    assert not any(layer == BAD[0] and BAD[1] in experts for layer, experts in fetches)
    assert client.stats()["n_checksum_error"] == checksum_errors
    assert engine.stats["rows_routed_around"] > 0  # the tiny model's router does choose it


def test_route_around_zero_fails_every_request_that_needs_the_bad_expert(bad_block_parts):
    client, runner, tokenizer, _ = bad_block_parts
    engine = make_engine(client, runner, tokenizer, 6, 3, route_around=0)
    for _ in range(2):
        assert any("error" in r for r in run(engine, PROMPTS, tokenizer))
    assert engine.degraded() == [] and engine.stats["experts_routed_around"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reroute_gives_a_dropped_expert_s_share_to_the_others(tiny_store, dtype):
    runner = ModelRunner(tiny_store)
    runner.route_around(1, [3, 5])
    index = torch.tensor([[3, 1], [2, 4], [5, 3], [0, 5]])
    weights = torch.tensor([[0.6, 0.2], [0.7, 0.3], [0.5, 0.5], [0.25, 0.5]], dtype=dtype)
    new_index, new_weights, rows = runner.reroute(1, index, weights)
    assert rows == 3 and new_weights.dtype == dtype
    # a dropped place points at a kept expert (or, all dropped, the lowest usable) with
    # weight 0; the kept ones take the row's total (scaled in float32)
    assert new_index.tolist() == [[1, 1], [2, 4], [0, 0], [0, 0]]
    want = torch.tensor([[0.0, 0.8], [0.7, 0.3], [0.0, 0.0], [0.75, 0.0]]).to(dtype)
    assert torch.equal(new_weights, want) if dtype == torch.bfloat16 else \
        torch.allclose(new_weights, want)


def test_a_layer_keeps_its_top_k(tiny_store):
    runner = ModelRunner(tiny_store)  # 8 experts, top-2: at most 6 routed around a layer
    assert runner.may_route_around(0, [0, 1, 2, 3, 4, 5])
    assert not runner.may_route_around(0, [0, 1, 2, 3, 4, 5, 6])


def test_io_errors_route_an_expert_around_only_after_strikes(tiny_store):
    """An io_error may be transient or the engine failing as a whole: an expert is routed
    around after IO_ERROR_STRIKES of them; a checksum failure routes it around at once."""
    tokenizer = load_tokenizer(tiny_store)
    engine = Engine(ModelRunner(tiny_store), tokenizer, 6, release=lambda: None,
                    route_around=4)
    for strike in range(IO_ERROR_STRIKES):
        assert engine.degraded() == []
        engine._route_around(ExpertLoadError("io_error", "EIO", 0, [2]))
    assert engine.degraded() == [{"layer": 0, "expert": 2}]
    engine._route_around(ExpertLoadError("checksum", "bad block", 1, [7]))
    assert engine.degraded()[-1] == {"layer": 1, "expert": 7}
    engine._route_around(ExpertLoadError("no_free_slot", "full", 1, [6]))  # not a bad block
    assert len(engine.degraded()) == 2 and engine.stats["experts_routed_around"] == 2
