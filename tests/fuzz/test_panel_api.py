"""Hostile requests to the control panel's and `serve`'s HTTP APIs, driven by their OpenAPI
schemas (``app.openapi()``): for every operation, hypothesis makes query parameters, headers
and JSON bodies (wrong types, huge and non-finite numbers, deep nesting, unicode with lone
surrogates, missing and unknown fields, bodies that are not JSON) and sends them to a real
server over real HTTP. Every answer must be below 500 (`serve` may answer 503 only with the
codes it documents for a busy or loading model), every 4xx must carry the API's typed error
body (the panel's ``{"detail"}``, OpenAI's ``{"error": {message, type, param, code}}``), and
the server must still answer ``/health`` afterwards.

An equivalent of schemathesis (not a dependency of this project), smaller: it generates from
the schema's own types and adds hostile values to every field rather than following every
JSON Schema keyword.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import quote, urlencode

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.config import load_config
from services.control_panel.app import make_app as make_panel_app
from services.control_panel.panel import Panel
from services.inference_worker.api import ServingState, make_app as make_serve_app
from tests.support.panel import TOKEN, panel_over_services, secret_settings
from tests.support.tiny_serve import tiny_serve

API_KEY = "fuzz-api-key"
SERVE_503_CODES = {"model_not_ready", "queue_full"}  # documented: loading, busy
METHODS = ("get", "put", "post", "delete", "patch")


def operations(schema: dict) -> list[tuple[str, str, dict]]:
    return [(path, method, op) for path, item in sorted(schema["paths"].items())
            for method, op in sorted(item.items()) if method in METHODS]


PANEL_SCHEMA = make_panel_app(Panel(load_config(env={}))).openapi()
SERVE_SCHEMA = make_serve_app(ServingState("fuzz")).openapi()

# --- values ------------------------------------------------------------------------------------

HUGE = [2 ** 63, -(2 ** 63) - 1, 2 ** 64, 10 ** 30, -(10 ** 400), 1e308, -1e308, 5e-324, -0.0]
ODD_TEXT = ["", " ", "\ud800", "\udfff\ud800", "\x00", "é" * 300, "💥", "NaN", "null", "1e999",
            "../../etc/passwd", "<script>", "a" * 3000, "%00", "{}", "[]"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.sampled_from(HUGE),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.sampled_from(ODD_TEXT))
hostile = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12)


def nested(depth: int) -> bytes:
    """JSON text nested ``depth`` deep (lists and objects), past what a recursive encoder
    or decoder takes."""
    opens = "".join('[' if i % 2 else '{"a":' for i in range(depth))
    closes = "".join(']' if i % 2 else '}' for i in reversed(range(depth)))
    return f"{opens}1{closes}".encode()


deep = st.integers(min_value=50, max_value=5000).map(nested)


def resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        node = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def from_schema(schema: dict, root: dict, depth: int = 0) -> st.SearchStrategy:
    """Values of the schema's own shape (small, mostly valid ones)."""
    schema = resolve(schema, root)
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        return st.one_of([from_schema(o, root, depth) for o in options])
    if "enum" in schema:
        return st.sampled_from(list(schema["enum"]))
    kind = schema.get("type")
    lo, hi = schema.get("minimum"), schema.get("maximum")
    plain = []
    for k in kind if isinstance(kind, list) else [kind]:
        if k == "string":
            plain.append(st.text(max_size=30))
        elif k == "integer":
            plain.append(st.integers(min_value=-2 if lo is None else int(lo),
                                     max_value=24 if hi is None else int(hi)))
        elif k == "number":
            plain.append(st.floats(min_value=-1.0 if lo is None else lo,
                                   max_value=2.0 if hi is None else hi))
        elif k == "boolean":
            plain.append(st.booleans())
        elif k == "array" and depth < 3:
            plain.append(st.lists(from_schema(schema.get("items", {}), root, depth + 1),
                                  min_size=schema.get("minItems", 0), max_size=3))
        elif k == "object" and depth < 3:
            plain.append(objects(schema, root, depth + 1))
    return st.one_of(*plain) if plain else hostile


def objects(schema: dict, root: dict, depth: int = 0) -> st.SearchStrategy:
    """The schema's required properties and up to three others, schema-shaped; then maybe a
    required one left out, one made hostile, unknown keys added."""
    props = dict(schema.get("properties", {}))
    if not props:
        return st.dictionaries(st.text(max_size=20), hostile, max_size=4)
    required = [name for name in schema.get("required", []) if name in props]
    optional = sorted(set(props) - set(required))

    @st.composite
    def build(draw):
        names = required + sorted(draw(st.sets(st.sampled_from(optional), max_size=3))
                                  if optional else [])
        value = {name: draw(from_schema(props[name], root, depth + 1)) for name in names}
        if draw(st.integers(0, 3)) == 3 and names:  # one field hostile
            value[draw(st.sampled_from(names))] = draw(hostile)
        if draw(st.integers(0, 7)) == 7 and required:  # a required field missing
            value.pop(draw(st.sampled_from(required)), None)
        if draw(st.integers(0, 7)) == 7:  # unknown keys
            value.update(draw(st.dictionaries(st.text(max_size=20), hostile, max_size=2)))
        return value

    return build()


def body_text(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def bodies(op: dict, root: dict) -> st.SearchStrategy:
    """JSON of the operation's body schema (when it has one), or hostile JSON, or bytes that
    are not JSON, or no body."""
    content = op.get("requestBody", {}).get("content", {}).get("application/json")
    shaped = objects(resolve(content["schema"], root), root) if content else hostile
    return st.one_of(
        shaped.map(body_text), shaped.map(body_text), shaped.map(body_text),
        hostile.map(body_text), deep,
        st.binary(max_size=64), st.sampled_from([b"", b"NaN", b"[", b'{"a":', b"\xff\xfe"]),
        st.none())


def queries(op: dict) -> st.SearchStrategy:
    names = [p["name"] for p in op.get("parameters", []) if p.get("in") == "query"]
    return st.dictionaries(st.sampled_from(names + ["x", "limit", "token"]),
                           st.one_of(st.text(max_size=20), st.sampled_from(ODD_TEXT[:12]),
                                     st.integers().map(str)), max_size=3)


header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=40)


def headers(token_name: str, token: str) -> st.SearchStrategy:
    """The token (right in most cases), maybe other headers, rarely a foreign Host."""
    @st.composite
    def build(draw):
        # hypothesis leans to small numbers: the rare branches are the large ones
        out = {token_name: draw(header_text) if draw(st.integers(0, 5)) == 5 else token}
        out.update(draw(st.fixed_dictionaries({}, optional={
            "Content-Type": st.sampled_from(["application/json", "text/plain", "",
                                             "application/json; charset=latin-1",
                                             "multipart/form-data"]),
            "Accept": header_text, "X-Fuzz": header_text})))
        if draw(st.integers(0, 9)) == 9:
            out["Host"] = draw(st.sampled_from(["evil.example", "localhost.evil", "[::2]:1"]))
        return out

    return build()


def send(port: int, method: str, path: str, query: dict, head: dict, body: bytes | None
         ) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        url = quote(path) + ("?" + urlencode(query, errors="surrogatepass") if query else "")
        conn.putrequest(method.upper(), url, skip_host="Host" in head,
                        skip_accept_encoding=True)
        for name, value in head.items():
            conn.putheader(name, value.encode("latin-1"))
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        reply = conn.getresponse()
        return reply.status, reply.read(), reply.headers.get("content-type", "")
    finally:
        conn.close()


# --- the panel ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def panel(tmp_path_factory):
    with panel_over_services(tmp_path_factory.mktemp("fuzz-panel"), *secret_settings()) as p:
        yield p


def check_panel_answer(status: int, data: bytes, kind: str, what: str) -> None:
    assert status < 500, f"{what} -> {status}: {data[:500]!r}"
    if 400 <= status < 500:
        assert kind.startswith("application/json"), f"{what} -> {status} {kind}: {data[:300]!r}"
        body = json.loads(data)
        assert isinstance(body, dict) and "detail" in body, f"{what} -> {status}: {body}"


def fuzz(port: int, path: str, method: str, op: dict, schema: dict, token: str,
         check) -> None:
    """Hostile requests to one operation, each answer judged by ``check``."""
    @settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(query=queries(op), head=headers("Authorization", f"Bearer {token}"),
           body=bodies(op, schema))
    def one(query, head, body):
        status, data, kind = send(port, method, path, query, head, body)
        event(f"HTTP {status}")
        check(status, data, kind, f"{method} {path} {query} {head} {body!r:.200}")

    one()


@pytest.mark.slow
@pytest.mark.parametrize("path,method,op", operations(PANEL_SCHEMA),
                         ids=[f"{m} {p}" for p, m, _ in operations(PANEL_SCHEMA)])
def test_panel_answers_hostile_requests_with_typed_refusals(panel, path, method, op):
    fuzz(panel.port, path, method, op, PANEL_SCHEMA, TOKEN, check_panel_answer)
    assert panel.request("GET", "/health")[0] == 200, panel.log()
    assert panel.proc.poll() is None


# --- serve ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    with tiny_serve(tmp_path_factory.mktemp("fuzz-serve"), f"serve.api_key={API_KEY}",
                    "serve.max_queue=4") as server:
        yield server


def check_serve_answer(status: int, data: bytes, kind: str, what: str) -> None:
    error = None
    if status >= 400:
        assert kind.startswith("application/json"), f"{what} -> {status} {kind}: {data[:300]!r}"
        body = json.loads(data)
        assert isinstance(body, dict) and isinstance(body.get("error"), dict), \
            f"{what} -> {status}: {body}"
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, f"{what}: {error}"
        assert isinstance(error["message"], str) and error["message"], f"{what}: {error}"
    if status == 503:
        assert error["code"] in SERVE_503_CODES, f"{what} -> 503: {error}"
    else:
        assert status < 500, f"{what} -> {status}: {data[:500]!r}"


@pytest.mark.slow
@pytest.mark.parametrize("path,method,op", operations(SERVE_SCHEMA),
                         ids=[f"{m} {p}" for p, m, _ in operations(SERVE_SCHEMA)])
def test_serve_answers_hostile_requests_with_openai_errors(serve, path, method, op):
    fuzz(serve.port, path, method, op, SERVE_SCHEMA, API_KEY, check_serve_answer)
    assert serve.get("/health")["status"] == "ok"
    assert serve.proc.poll() is None
