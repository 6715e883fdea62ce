"""The control panel's HTTP face (FastAPI): the page, the JSON API, Prometheus metrics, docs.

  GET  /                the page (live charts, residency heat map, config, tuning forms)
  GET  /api/stats       every service's stats from its control socket, and derived rates
  GET  /api/history     the rates over the last minutes (the charts)
  GET  /api/residency   per layer, resident experts and their popularity (when reported)
  GET  /api/config      the effective config, each field with doc, default, range, live flag
  PUT  /api/config      {"changes": {"section.field": value}}: 401 without the token, 422 for
                        an unknown field or a value out of range, 409 for what cannot change
                        while running, else applied through the services' control sockets
  GET  /metrics         Prometheus text format (names, types and help from ``core.METRICS``)
  GET  /health          200 while the panel runs, with the services that answered
  GET  /docs            Swagger UI from local assets (scripts/setup.sh); /openapi.json always

Reads are open (the page, scrapers and healthchecks use them) and show no secret; writes need
the token. A request whose Host header is not allowed (``panel.allowed_hosts``, the loopback
names, the listening address) gets 400 before any route: a web page cannot reach a loopback
panel through DNS rebinding. Every error is JSON ``{"detail": ...}``.

The page and its chart library (uPlot) are served from ``static/``, never from a CDN: an edge
box has no internet. Everything the API says about fields comes from common/config.py through
``core`` (the request's JSON Schema included).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, Field

from common.config import LOOPBACK_HOSTS, host_name

from .core import (PANEL_METRICS, RATE_METRICS, Metric, changes_schema, clip_depth,
                   json_safe, metric_samples)
from .panel import Panel

STATIC = Path(__file__).resolve().parent / "static"
SWAGGER = STATIC / "vendor" / "swagger-ui"


class ConfigUpdate(BaseModel):
    """A set of live changes, applied together or not at all."""
    changes: dict[str, Any] = Field(
        description="section.field -> new value (see GET /api/config for each field's range "
                    "and live flag)",
        json_schema_extra=changes_schema())


class FieldRow(BaseModel):
    key: str
    type: str
    value: Any
    default: Any
    doc: str
    lo: float | None
    hi: float | None
    choices: list | None
    size: bool
    multiple_of: int | None
    live: bool
    fixed_because: str
    secret: bool


class ConfigView(BaseModel):
    source: str = Field(description="the service whose effective config this is")
    profile: str | None
    fields: list[FieldRow]
    tuned: dict[str, Any] = Field(description="live changes applied through the panel")


class StatsCollector:
    """Prometheus view of the panel's latest stats round: ``flashmoe_up{service}``, each
    service's stats as ``core.METRICS`` names, types and describes them
    (``flashmoe_<service>_<name>``), the panel's own counters and the derived rates
    (``flashmoe_hit_ratio``...)."""

    def __init__(self, panel: Panel) -> None:
        self.panel = panel

    def collect(self):
        view = self.panel.stats_view()
        up = GaugeMetricFamily("flashmoe_up", "1 when the service answered the last stats "
                               "round, else 0.", labels=["service"])
        for name in view["services"]:
            up.add_metric([name], 1)
        for name in view["unavailable"]:
            up.add_metric([name], 0)
        yield up
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        samples = [sample for service, values in sorted(view["services"].items())
                   for sample in metric_samples(service, values)]
        samples += [(f"flashmoe_panel_{metric.name}", metric, {}, value * metric.scale)
                    for key, metric in PANEL_METRICS.items()
                    if isinstance(value := view["panel"].get(key), (int, float))]
        samples += [(f"flashmoe_{metric.name}", metric, {}, value * metric.scale)
                    for key, metric in RATE_METRICS.items()
                    if isinstance(value := view["rates"].get(key), (int, float))]
        for name, metric, labels, value in samples:
            family = families.get(name)
            if family is None:
                family = families[name] = _family(name, metric, list(labels))
            family.add_metric(list(labels.values()), value)
        yield from families.values()


def _family(name: str, metric: Metric, labels: list[str]):
    kind = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
    return kind(name, metric.help, labels=labels)


def host_check(allowed: frozenset[str] | None):
    """A middleware that answers 400 to a request whose Host header names a host not in
    ``allowed`` (None: any host)."""

    async def check(request: Request, call_next):
        given = request.headers.get("host")
        if allowed is not None and given is not None and host_name(given) not in allowed:
            return JSONResponse({"detail": f"Host {given!r} is not allowed: the panel answers "
                                           f"{', '.join(sorted(allowed))} (add the name to "
                                           f"panel.allowed_hosts)"}, status_code=400)
        return await call_next(request)

    return check


def make_app(panel: Panel, allowed_hosts: frozenset[str] | None = frozenset(LOOPBACK_HOSTS)
             ) -> FastAPI:
    """The panel's app, answering requests whose Host is in ``allowed_hosts`` (None: any;
    see ``common.config.allowed_hosts``)."""
    app = FastAPI(title="FlashMoE control panel", docs_url=None, redoc_url=None,
                  description="Live stats and tuning of the FlashMoE services, over their "
                              "control sockets. Changes need the token printed at start.")
    app.middleware("http")(host_check(allowed_hosts))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler fails (500) on a body that is not UTF-8 or holds NaN, and
        # an input nested hundreds deep is past the recursive encoders: echoed clipped
        errors = [{**e, "input": clip_depth(e["input"])} if "input" in e else e
                  for e in exc.errors()]
        return JSONResponse({"detail": json_safe(jsonable_encoder(
            errors, custom_encoder={bytes: lambda b: b.decode("utf-8", "replace")}))},
            status_code=422)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(panel))

    def require_token(authorization: str | None = Header(default=None),
                      x_flashmoe_token: str | None = Header(default=None)) -> None:
        given = x_flashmoe_token or ""
        if authorization and authorization.lower().startswith("bearer "):
            given = authorization[7:].strip()
        if not given or not secrets.compare_digest(given.encode(), panel.token.encode()):
            raise HTTPException(401, "a change needs the panel's token (printed at start): "
                                     "header 'Authorization: Bearer <token>' or "
                                     "'X-FlashMoE-Token'",
                                headers={"WWW-Authenticate": "Bearer"})

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    @app.get("/api/stats", summary="Every service's stats and the derived rates")
    def get_stats() -> dict[str, Any]:
        return panel.stats_view()

    @app.get("/health", summary="200 while the panel runs, with the services that answered")
    def health() -> dict[str, Any]:
        view = panel.stats_view()
        return {"status": "ok", "services": sorted(view["services"]),
                "unavailable": sorted(view["unavailable"])}

    @app.get("/api/history", summary="The derived rates over the last minutes")
    def get_history() -> dict[str, list]:
        return panel.history_view()

    @app.get("/api/residency", summary="Per layer: resident experts and their popularity")
    def get_residency() -> dict[str, Any]:
        return panel.residency_view()

    @app.get("/api/config", response_model=ConfigView,
             summary="The effective config with each field's doc, default, range, live flag")
    def get_config() -> dict[str, Any]:
        return panel.config_view()

    @app.put("/api/config", dependencies=[Depends(require_token)],
             summary="Apply live config changes to the running services",
             responses={401: {"description": "no or wrong token"},
                        409: {"description": "a field that cannot change while running, with "
                                             "the reason"},
                        422: {"description": "an unknown field, or a value out of its range "
                                             "(named with the range)"},
                        503: {"description": "no service answered"}})
    def put_config(update: ConfigUpdate) -> JSONResponse:
        outcome = panel.apply(update.changes)
        return JSONResponse(json_safe(outcome.body), status_code=outcome.status)

    @app.get("/metrics", summary="Prometheus text format")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        if (SWAGGER / "swagger-ui-bundle.js").is_file():
            return get_swagger_ui_html(
                openapi_url="/openapi.json", title="FlashMoE control panel API",
                swagger_js_url="/static/vendor/swagger-ui/swagger-ui-bundle.js",
                swagger_css_url="/static/vendor/swagger-ui/swagger-ui.css",
                swagger_favicon_url="/static/favicon.svg",
                swagger_ui_parameters={"validatorUrl": None})  # no call to swagger.io
        return HTMLResponse("<!doctype html><title>FlashMoE API</title><h1>FlashMoE control "
                            "panel API</h1><p>The Swagger UI assets are not installed (run "
                            "<code>scripts/setup.sh</code>; they come from npm, never a CDN). "
                            "The schema itself is at <a href='/openapi.json'>/openapi.json</a>."
                            "</p>")

    def openapi() -> dict[str, Any]:
        """The schema, with the choices the running services give (the cache manager's
        policies) in the change's schema; made again each time, as they come and go."""
        app.openapi_schema = None
        schema = FastAPI.openapi(app)
        changes = schema["components"]["schemas"]["ConfigUpdate"]["properties"]["changes"]
        changes.update(changes_schema(panel.service_choices()[0]))
        return schema

    app.openapi = openapi
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
