"""`flashmoe serve`'s API as the panel's exposure rules have it (issue 23): a Host-header
allow-list (400 ``host_not_allowed`` in OpenAI's error shape), every refusal in OpenAI's shape
(an unknown route and a wrong method too), reads that show no secret, /metrics by Prometheus'
conventions, and the HTTP answer to a request whose experts could not be loaded (502
``expert_load_failed``) or whose cache manager went away (503 ``cache_restarted``).

A real `flashmoe serve` of a tiny Qwen3-MoE over real HTTP, as tests/integration/test_serve.py
runs it.
"""

from __future__ import annotations

import http.client
import json
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.cache_client import CacheManagerUnavailable, ExpertLoadError
from services.inference_worker.api import failure
from tests.support.serving import Server
from tests.support.tiny_serve import tiny_serve

pytestmark = pytest.mark.slow
API_KEY = "serve-exposure-key-31f0"


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    with tiny_serve(tmp_path_factory.mktemp("serve-exposure"), f"serve.api_key={API_KEY}",
                    "serve.allowed_hosts=llm.lan") as server:
        yield server


def call(server: Server, method: str, path: str, host: str | None = None,
         body: dict | None = None, key: str | None = API_KEY) -> tuple[int, str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.putrequest(method, path, skip_host=host is not None)
        if host is not None:
            conn.putheader("Host", host)
        if key:
            conn.putheader("Authorization", f"Bearer {key}")
        data = json.dumps(body).encode() if body is not None else b""
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        reply = conn.getresponse()
        return reply.status, reply.read().decode(), reply.headers.get("content-type", "")
    finally:
        conn.close()


def openai_error(text: str) -> dict:
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "[::2]:80", "llm.lan.evil"])
@pytest.mark.parametrize("method,path", [("GET", "/health"), ("GET", "/v1/models"),
                                         ("POST", "/v1/completions"), ("GET", "/metrics")])
def test_a_foreign_host_is_refused_with_400(serve, host, method, path):
    status, text, _ = call(serve, method, path, host=host,
                           body={"prompt": "hi", "max_tokens": 1} if method == "POST" else None)
    assert status == 400
    error = openai_error(text)
    assert error["code"] == "host_not_allowed" and "serve.allowed_hosts" in error["message"]



@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "llm.lan", "LLM.LAN."])
def test_loopback_and_configured_names_are_answered(serve, host):
    status, text, _ = call(serve, "GET", "/v1/models", host=f"{host}:{serve.port}")
    assert status == 200, text


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/no/such/route", 404, "not_found"), ("DELETE", "/v1/completions", 405,
                                                  "method_not_allowed")])
def test_every_refusal_has_openai_s_shape(serve, method, path, status, code):
    got, text, kind = call(serve, method, path)
    assert got == status and kind.startswith("application/json")
    assert openai_error(text)["code"] == code


def test_a_body_nested_past_the_parser_s_depth_is_a_400(serve):
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
    body = ("[" * 100_000 + "]" * 100_000).encode()
    conn.request("POST", "/v1/completions", body,
                 {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 400 and openai_error(reply.read().decode())["param"] is None
    conn.close()


@pytest.mark.parametrize("field,value", [("seed", 2 ** 64), ("seed", -(2 ** 63) - 1),
                                         ("top_p", 10 ** 400), ("temperature", 10 ** 400)])
def test_numbers_out_of_range_are_a_400_naming_them(serve, field, value):
    status, text, _ = call(serve, "POST", "/v1/completions",
                           body={"prompt": "hi", "max_tokens": 2, field: value})
    assert status == 400, text
    assert openai_error(text)["param"] == field
    assert call(serve, "GET", "/health")[0] == 200


@pytest.mark.parametrize("path", ["/health", "/stats", "/metrics", "/v1/models"])
def test_reads_show_no_secret(serve, path):
    status, text, _ = call(serve, "GET", path)
    assert status == 200
    assert API_KEY not in text


def test_metrics_follow_the_prometheus_conventions(serve):
    call(serve, "POST", "/v1/completions", body={"prompt": "hello", "max_tokens": 3})
    status, text, kind = call(serve, "GET", "/metrics")
    assert status == 200 and kind.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "flashmoe_serve_requests" in families
    for name, family in families.items():
        assert family.documentation.strip(), f"{name} has no help"
        assert not re.search(r"_(ms|us|mb|kb|mib|gb|percent)(_|$)", name), name
        assert not re.search(r"(^|_)pids?(_|$)", name), name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), name


def test_a_failed_expert_load_is_a_502_and_a_lost_cache_a_503():
    error = failure(ExpertLoadError("checksum", "block 17 of stripe_1.bin is damaged", 3,
                                    [2, 5]))
    assert (error.status, error.code, error.type) == (502, "expert_load_failed", "server_error")
    assert "experts 2, 5 of layer 3" in str(error) and "block 17" in str(error)
    lost = failure(CacheManagerUnavailable("the cache manager restarted"))
    assert (lost.status, lost.code) == (503, "cache_restarted")
    assert failure(RuntimeError("boom")).status == 500
