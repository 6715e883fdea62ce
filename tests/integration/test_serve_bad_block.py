"""A bad block under `flashmoe serve` costs the request that met it, not the server: a real
tiny model's store with one expert's block damaged (a flipped bit) is served; the first request
that routes to it gets 502 ``expert_load_failed``, the model is then computed without that
expert, every later request is answered, and the degradation is said (``/health``, the
``X-FlashMoE-Routed-Around`` header, ``/stats``)."""

from __future__ import annotations

import json
from email.message import Message
import urllib.error
import urllib.request

import pytest

from tests.support.stores import flip_byte
from tests.support.tiny_serve import tiny_serve

pytestmark = pytest.mark.slow
BAD = (1, 3)
PROMPTS = ["The store", "Experts on SSD", "A cache of experts", "Routing", "FlashMoE", "Tokens"]


def complete(url: str, prompt: str) -> tuple[int, dict, Message]:
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read()), reply.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def stream(url: str, prompt: str) -> list[dict]:
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        lines = reply.read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_bad_block_costs_one_request_and_the_server_routes_around_it(tmp_path):
    with tiny_serve(tmp_path, damage=lambda store: flip_byte(store, *BAD)) as server:
        assert server.get("/health") == {"status": "ok"}
        answers = [complete(server.url, prompt) for prompt in PROMPTS]
        statuses = [status for status, _, _ in answers]
        assert statuses.count(502) == 1, statuses
        failed = statuses.index(502)
        assert failed < len(PROMPTS) - 1, "the bad expert was met last: nothing after it"
        assert all(status == 200 for status in statuses[failed + 1:]), statuses
        error = answers[failed][1]["error"]
        assert error["code"] == "expert_load_failed" and "checksum" in error["message"]
        marked = [prompt for prompt, (status, body, headers) in zip(PROMPTS, answers)
                  if headers.get("X-FlashMoE-Routed-Around")]
        assert marked, "no answer said it was computed without the bad expert"
        assert {answers[PROMPTS.index(p)][2]["X-FlashMoE-Routed-Around"] for p in marked} \
            == {f"{BAD[0]}:{BAD[1]}"}
        # a stream of the same prompt (greedy: the same routing) says it in its last chunk
        chunks = stream(server.url, marked[0])
        assert chunks[-1].get("flashmoe_routed_around") == f"{BAD[0]}:{BAD[1]}"
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
            answers[PROMPTS.index(marked[0])][1]["choices"][0]["text"]
        health = server.get("/health")
        assert health["status"] == "degraded"
        assert health["routed_around"] == [{"layer": BAD[0], "expert": BAD[1]}]
        stats = server.stats()
        assert stats["experts_routed_around"] == 1 and stats["requests_failed"] == 1
        assert stats["rows_routed_around"] > 0
        assert "flashmoe verify" in health["fix"]
