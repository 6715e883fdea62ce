"""The OpenAI-compatible HTTP API of `flashmoe serve` (FastAPI).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (plain
JSON, or server-sent events ending with ``data: [DONE]`` when ``stream`` is true),
``GET /health`` (200 once the engine can serve, else 503), ``GET /stats`` (JSON: the
engine's and the cache's figures) and ``GET /metrics`` (Prometheus). The handlers never run
the model: a request goes into the engine's bounded queue and its text comes back through an
asyncio queue, fed from the model loop's thread. A client that disconnects cancels its
request. Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, all
of them (an unknown route, a wrong method and a refused Host too). A request whose Host header
is not allowed (``ServingState.allowed_hosts``: the loopback names, the listening address and
``serve.allowed_hosts``) gets 400 ``host_not_allowed`` before any route (DNS rebinding). A
request that fails because experts could not be loaded gets 502 ``expert_load_failed`` (the
layer, the experts and why); experts whose blocks are bad are then routed around (see the
engine): ``/health`` says ``degraded`` with their list, and an answer computed without one
carries the header ``X-FlashMoE-Routed-Around`` (a stream: the field ``flashmoe_routed_around``
in its last chunk). One that loses the cache manager gets 503 ``cache_restarted``.
The schema (``app.openapi()``, not served) describes the request bodies.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.config import LOOPBACK_HOSTS, host_name

from .engine import QueueFull, Request as EngineRequest, RequestError, SamplingParams

DISCONNECT_CHECK_S = 0.5
DEFAULT_MAX_TOKENS = 16
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what a torch generator takes


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class HostCheck:
    """ASGI middleware: 400 ``host_not_allowed`` for a request whose Host header names a host
    not in ``allowed`` (None: any). Plain ASGI, so that streamed answers and disconnects pass
    through untouched."""

    def __init__(self, app, allowed: frozenset[str] | None) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.allowed is not None:
            given = dict(scope["headers"]).get(b"host")
            if given is not None and \
                    host_name(given.decode("latin-1")) not in self.allowed:
                error = APIError(400, f"Host {given.decode('latin-1')!r} is not allowed: this "
                                      f"server answers {', '.join(sorted(self.allowed))} (add "
                                      f"the name to serve.allowed_hosts)",
                                 code="host_not_allowed")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


# The request bodies, for the schema (the handlers parse and check them themselves, with
# OpenAI's error shape).
_SAMPLING = {
    "model": {"type": "string"}, "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0}, "top_p": {"type": "number"},
    "top_k": {"type": "integer"}, "seed": {"type": "integer"}, "n": {"type": "integer"},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "stream": {"type": "boolean"}, "ignore_eos": {"type": "boolean"},
    "stream_options": {"type": "object",
                       "properties": {"include_usage": {"type": "boolean"}}}}
COMPLETION_SCHEMA = {"type": "object", "required": ["prompt"], "properties": {
    **_SAMPLING, "prompt": {"anyOf": [{"type": "string"},
                                      {"type": "array", "items": {"type": "integer"}}]},
    "echo": {"type": "boolean"}, "suffix": {"type": "string"},
    "logprobs": {"type": "integer"}}}
CHAT_SCHEMA = {"type": "object", "required": ["messages"], "properties": {
    **_SAMPLING, "max_completion_tokens": {"type": "integer", "minimum": 1},
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"type": "string"}, "content": {"type": "string"}}}}}}


def _body_schema(schema: dict) -> dict:
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


@dataclass
class ServingState:
    """What the app serves: set by the worker process, read by the handlers."""
    model_name: str
    api_key: str = ""
    engine: object = None  # an Engine once it can serve
    tokenizer: object = None
    load_error: str = ""
    cache_stats: Callable[[], dict] = dict  # the cache manager's stats (may raise)
    predictor_stats: Callable[[], dict] = dict
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: object = None  # a RequestMetrics
    # Host names answered (common.config.allowed_hosts(serve.allowed_hosts, serve.host));
    # None: any
    allowed_hosts: frozenset[str] | None = frozenset(LOOPBACK_HOSTS)


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """A completion prompt's token ids: the tokenizer's own encoding with its special
    tokens, as `flashmoe generate` does."""
    return list(tokenizer(prompt)["input_ids"])


def chat_prompt(tokenizer, messages) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template (its tokenizer files carry "
                            "none): use /v1/completions", param="messages",
                       code="no_chat_template")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise APIError(400, "messages must be a non-empty list of {role, content}",
                       param="messages")
    plain = []
    for m in messages:
        content = m.get("content", "")
        if isinstance(content, list):  # content parts: the text ones
            content = "".join(part.get("text", "") for part in content
                              if isinstance(part, dict) and part.get("type") == "text")
        if not isinstance(content, str):
            raise APIError(400, "a message's content must be text", param="messages")
        plain.append({"role": m["role"], "content": content})
    text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _number(body: dict, key: str, kind, default):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not (math.isfinite(value) and
                                               (kind is float or value.is_integer()))):
        raise APIError(400, f"{key} must be {'an integer' if kind is int else 'a number'}",
                       param=key)
    try:
        return kind(value)
    except OverflowError:  # an integer too large for a float
        raise APIError(400, f"{key} is out of range", param=key) from None


def sampling_params(body: dict, max_tokens_key: str = "max_tokens") -> SamplingParams:
    if not isinstance(body.get("stream_options") or {}, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    n = _number(body, "n", int, 1)
    if n != 1:
        raise APIError(400, "only n = 1 is supported", param="n")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise APIError(400, "stop must be a string or a list of strings", param="stop")
    max_tokens = body.get(max_tokens_key, body.get("max_tokens"))
    params = SamplingParams(
        max_tokens=_number({"max_tokens": max_tokens}, "max_tokens", int, DEFAULT_MAX_TOKENS),
        temperature=_number(body, "temperature", float, 1.0),
        top_p=_number(body, "top_p", float, 1.0), top_k=_number(body, "top_k", int, 0),
        seed=_number(body, "seed", int, None), stop=stop,
        ignore_eos=bool(body.get("ignore_eos", False)))
    if params.top_k < 0:  # -1 means all, as in vLLM
        params.top_k = 0 if params.top_k == -1 else params.top_k
    if params.seed is not None and not SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]:
        raise APIError(400, f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]",
                       param="seed")
    try:
        params.check()
    except RequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    return params


def make_app(state: ServingState) -> FastAPI:
    app = FastAPI(title="FlashMoE", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(HostCheck, allowed=state.allowed_hosts)

    def check_key(request: Request) -> None:
        if state.api_key:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                raise APIError(401, "a valid API key is needed (Authorization: Bearer <key>)",
                               type_="authentication_error", code="invalid_api_key")

    def ready_engine():
        if state.engine is None:
            raise APIError(503, "the model is still loading" if not state.load_error else
                           f"the model could not be loaded: {state.load_error}",
                           type_="server_error", code="model_not_ready")
        return state.engine

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not JSON") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != state.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server has "
                                f"{state.model_name!r}", param="model", code="model_not_found")
        return body

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = APIError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(error.body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError):
        return APIError(400, f"the request is not valid: {exc.errors()!r:.500}").response()

    @app.get("/health")
    async def health():
        if state.engine is None:
            return JSONResponse({"status": "loading" if not state.load_error else "failed",
                                 "error": state.load_error or None}, status_code=503)
        degraded = state.engine.degraded()
        if degraded:  # serving, with experts routed around: say which and what to do
            return {"status": "degraded", "routed_around": degraded,
                    "fix": "a bad block: run `flashmoe verify` on the store, convert it "
                           "again, restart"}
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        engine = state.engine
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "flashmoe",
            "max_model_len": engine.context_length if engine is not None else None}]}

    @app.post("/v1/completions", openapi_extra=_body_schema(COMPLETION_SCHEMA))
    async def completions(request: Request):
        check_key(request)
        body = await body_of(request)
        engine = ready_engine()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = encode_prompt(state.tokenizer, prompt)
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(state.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"a prompt token id is outside [0, {vocab})",
                               param="prompt")
            ids = list(prompt)
        else:
            raise APIError(400, "prompt must be a string (or one token id list)",
                           param="prompt")
        if body.get("echo") or body.get("suffix") or body.get("logprobs"):
            raise APIError(400, "echo, suffix and logprobs are not supported",
                           param="echo" if body.get("echo") else
                           "suffix" if body.get("suffix") else "logprobs")
        return await generate(request, body, engine, ids, sampling_params(body), chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(CHAT_SCHEMA))
    async def chat_completions(request: Request):
        check_key(request)
        body = await body_of(request)
        engine = ready_engine()
        ids = chat_prompt(state.tokenizer, body.get("messages"))
        params = sampling_params(body, "max_completion_tokens")
        return await generate(request, body, engine, ids, params, chat=True)

    async def generate(request: Request, body: dict, engine, ids: list[int],
                       params: SamplingParams, chat: bool):
        try:
            engine.clamp(ids, params)
        except RequestError as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind: str, payload) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload, time.monotonic()))

        job = EngineRequest(ids, params, emit)
        try:
            engine.submit(job)
        except QueueFull as exc:
            raise APIError(503, f"the server is busy: {exc}", type_="server_error",
                           code="queue_full") from None
        metrics = state.metrics
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": state.model_name}
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def next_event():
            kind, payload, at = await events.get()
            if metrics is not None:
                metrics.observe(job, kind, at)
            return kind, payload

        if body.get("stream"):
            async def stream():
                done = False
                try:
                    if chat:
                        yield _sse({**head, "choices": [{"index": 0, "delta": {
                            "role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}]})
                    while True:
                        kind, payload = await next_event()
                        if kind == "text":
                            if payload:
                                yield _sse({**head, "choices": [_choice(chat, payload, None,
                                                                        stream=True)]})
                        elif kind == "done":
                            done = True
                            yield _sse({**head, "choices": [_choice(
                                chat, "", payload["finish_reason"], stream=True)],
                                **routed_around_field(engine, payload)})
                            if include_usage:
                                yield _sse({**head, "choices": [], "usage": _usage(payload)})
                            break
                        else:
                            done = True
                            error = failure(payload)
                            yield _sse({"error": {"message": str(error), "type": error.type,
                                                  "param": None, "code": error.code}})
                            break
                    yield "data: [DONE]\n\n"
                finally:
                    if not done:
                        job.cancel()

            return StreamingResponse(stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        pieces = []
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(next_event(), DISCONNECT_CHECK_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancel()
                        return Response(status_code=499)
                    continue
                if kind == "text":
                    pieces.append(payload)
                elif kind == "done":
                    break
                else:
                    raise failure(payload)
        except asyncio.CancelledError:
            job.cancel()
            raise
        text = "".join(pieces)
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": [_choice(chat, text, payload["finish_reason"])],
                             "usage": _usage(payload)},
                            headers=routed_around_header(engine, payload))

    @app.get("/stats")
    async def stats():
        return await asyncio.to_thread(serving_stats, state)

    @app.get("/metrics")
    async def metrics():
        text = await asyncio.to_thread(lambda: state.metrics.render(serving_stats(state)))
        return Response(text, media_type="text/plain; version=0.0.4")

    return app


def failure(error: BaseException) -> APIError:
    """A generation that failed: 502 when experts could not be loaded (a bad block, an IO
    error: the request fails, the server goes on), 503 when the cache manager went away (it
    is restarted and the next request reconnects), else 500."""
    from common.cache_client import CacheManagerUnavailable, ExpertLoadError

    if isinstance(error, ExpertLoadError):
        experts = ", ".join(map(str, error.experts))
        return APIError(502, f"experts {experts} of layer {error.layer} could not be loaded: "
                             f"{error}", type_="server_error", code="expert_load_failed")
    if isinstance(error, CacheManagerUnavailable):
        return APIError(503, f"the expert cache restarted during this request: {error}; "
                             f"try again", type_="server_error", code="cache_restarted")
    return APIError(500, f"generation failed: {error!r}", type_="server_error")


def _sse(doc: dict) -> str:
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n"


def _choice(chat: bool, text: str, finish: str | None, stream: bool = False) -> dict:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if stream:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                "finish_reason": finish}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish}


def _usage(done: dict) -> dict:
    return {"prompt_tokens": done["prompt_tokens"],
            "completion_tokens": done["completion_tokens"],
            "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}


def routed_around(engine, done: dict) -> str:
    """``"L:E,..."``: the experts routed around, when the answer ``done`` describes was
    computed without one of them (some of its rows chose one), else ""."""
    if not done.get("routed_around_rows"):
        return ""
    return ",".join(f"{d['layer']}:{d['expert']}" for d in engine.degraded())


def routed_around_header(engine, done: dict) -> dict[str, str]:
    """``X-FlashMoE-Routed-Around: L:E,...`` on an answer computed without a bad expert (it
    may differ from the whole model's), else nothing."""
    experts = routed_around(engine, done)
    return {"X-FlashMoE-Routed-Around": experts} if experts else {}


def routed_around_field(engine, done: dict) -> dict[str, str]:
    """The same in a stream's last chunk (``flashmoe_routed_around``): a stream's headers go
    before its first token."""
    experts = routed_around(engine, done)
    return {"flashmoe_routed_around": experts} if experts else {}


def serving_stats(state: ServingState) -> dict:
    """/stats: the engine's counters and the cache manager's figures (null where a service
    does not answer)."""
    engine = state.engine
    out: dict = {"model": state.model_name, "ready": engine is not None}
    if engine is not None:
        s = dict(engine.stats)
        hinted = s.pop("lookahead_hinted")
        hits = s.pop("lookahead_hits")
        s.pop("lookahead_samples")
        out.update(s, queue_length=engine.queue_length(), running=len(engine.active),
                   router_lookahead=engine.runner.lookahead,
                   router_lookahead_hinting=engine.lookahead_hinting(),
                   router_lookahead_recall=round(hits / hinted, 4) if hinted else None)
    try:
        c = state.cache_stats()
    except Exception as exc:  # noqa: BLE001 - a dead peer is a figure, not a crash
        out["cache_error"] = str(exc)
        c = None
    if c:
        n = c["n_hit"] + c["n_miss"]
        out.update(hit_rate=round((c["n_hit"] + c["n_hit_loading"]) / n, 4) if n else None,
                   stall_free_rate=round(c["n_hit"] / n, 4) if n else None,
                   estimate=c.get("estimate"), estimates_used=c.get("estimates_used", 0),
                   evictions=c["n_evict"], prefetch_learned=c.get("prefetch_learned", 0),
                   bytes_read=c["n_byte_read"], policy=c.get("policy"),
                   cache_capacity=c.get("capacity"), cache_pinned=c.get("pinned"),
                   cache_hits=c["n_hit"], cache_misses=c["n_miss"], cache_pid=c.get("pid"))
    try:
        p = state.predictor_stats()
    except Exception:  # noqa: BLE001
        p = None
    if p:
        out.update(predictor_tokens=p.get("tokens"), predictor_recall=p.get("recall_at_k"))
    return out
