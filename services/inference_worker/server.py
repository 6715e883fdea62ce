"""The inference worker in its serving form: `flashmoe serve`'s model behind an HTTP API.

One process: uvicorn serves the OpenAI-compatible API (``api.py``) on a thread of its own,
the model loop (``engine.py``) runs on another, and the two meet in the engine's bounded
queue, so the front end never waits on the model. The model is loaded once, on a loader
thread while the API already answers (``/health`` is 503 until the engine can serve). Its
experts come through the cache manager (one ``CacheClient``); one AccessEvent per prompt
position and decode step goes to the feature extractor (``events``). A cache manager that
goes away (a restart), or drops this worker (frozen past the heartbeat timeout: ``PinsLost``),
is reconnected to and the step in progress done again, nothing of it emitted; a block that
fails to load fails the requests that need it (the engine's ``step``).

The process runs on the service skeleton (common/service.py): SIGTERM/SIGINT end it, after
which the engine stops, the client releases its pins and the listening socket closes. Once
listening it writes ``<runtime_dir>/serve.json`` (its URL and pid) and removes it at exit.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

from common.bus import control_endpoint_for
from common.bus import stats as control_stats
from common.cache_client import ArenaUnreachable, CacheClient, CacheManagerUnavailable
from common.config import FlashMoEConfig, allowed_hosts
from common.service import Service, ServiceFailed, run_service_process
from common.store import StoreError

from .api import ServingState, make_app
from .engine import Engine
from .events import EventPublisher
from .generate import arena_fetch, load_tokenizer, same_store, store_model_shape
from .metrics import RequestMetrics
from .model_runner import ModelRunner

INFO_FILE = "serve.json"
EXIT_CANNOT_LISTEN = 2
STATS_TIMEOUT_S = 2.0


class CannotListen(ServiceFailed):
    exit_code = EXIT_CANNOT_LISTEN


class ModelNotLoaded(ServiceFailed):
    what = "a model that cannot be loaded"


class WebServerStopped(ServiceFailed):
    what = "the web server stopped"


class ArenaLost(ServiceFailed):
    what = "a cache manager whose arena this process cannot map"


def model_name(config: FlashMoEConfig, store: str | Path) -> str:
    return config.serve.model_name or Path(store).resolve().name


class Connection:
    """The worker's link to the cache manager. A manager that went away (restarted by its
    supervisor, or one that dropped this worker) fails the fetch in progress and the client is
    dropped; the next fetch (the engine does the step again) connects anew. A new manager
    whose arena this process cannot map (``ArenaUnreachable``) is noted in ``unreachable``:
    the worker then exits, for its supervisor (or container engine) to start it again."""

    def __init__(self, endpoint: str, config: FlashMoEConfig,
                 shape: dict[str, int] | None = None) -> None:
        self.endpoint, self.config, self.shape = endpoint, config, shape
        self.client: CacheClient | None = None
        self.unreachable: str | None = None  # why no new client of this process can work
        self.runner: ModelRunner | None = None
        self.connect()

    def connect(self) -> CacheClient:
        if self.client is None:
            try:
                self.client = CacheClient(self.endpoint, self.config, name="serve",
                                          shape=self.shape)
            except ArenaUnreachable as exc:
                self.unreachable = str(exc)  # the worker's on_tick ends the process
                raise
            self._fetch = arena_fetch(self.client)
            if self.runner is not None:
                self.runner._last_layer = None  # the new manager holds no pins of ours
        return self.client

    def drop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def attach(self, runner: ModelRunner) -> None:
        self.runner = runner
        runner.fetch = self.fetch

    def fetch(self, layer, experts, release_layers, token, weights=()):
        self.connect()
        try:
            return self._fetch(layer, experts, release_layers, token, weights)
        except CacheManagerUnavailable:
            self.drop()
            raise

    def release(self) -> None:
        if self.client is None:
            return
        try:
            self.client.release()
        except CacheManagerUnavailable:
            self.drop()

    def hint(self, layer: int, experts: list[int]) -> None:
        if self.client is None:
            return
        try:
            self.client.prefetch(layer, experts)
        except CacheManagerUnavailable:
            self.drop()

    def set_step(self, step: int) -> None:
        if self.client is not None:
            self.client.step = step

    def lost(self) -> bool:
        """Whether the client lost its pins (``CacheClient.lost``); a lost one is dropped,
        the next fetch connects anew."""
        if self.client is not None and self.client.lost():
            self.drop()
            return True
        return False

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.release()
            except CacheManagerUnavailable:
                pass
        self.drop()


def build_engine(config: FlashMoEConfig, store: str | Path, connection: Connection,
                 publisher: EventPublisher | None) -> tuple[Engine, object]:
    """The model (non-expert weights in RAM, experts through ``connection``), its tokenizer
    and the engine over them."""
    store = Path(store)
    client = connection.client
    if not same_store(client.store, store):
        raise StoreError(f"the cache manager at {connection.endpoint} serves "
                         f"{client.store.path}, not the store {store}")
    tokenizer = load_tokenizer(store)
    runner = ModelRunner(store)
    runner.lookahead = config.prefetch.router_lookahead
    connection.attach(runner)
    engine = Engine(runner, tokenizer, client.ready.n_slots, release=connection.release,
                    hint=connection.hint if runner.lookahead else None, publisher=publisher,
                    set_step=connection.set_step, lost=connection.lost,
                    max_queue=config.serve.max_queue,
                    max_batch=config.serve.max_batch,
                    route_around=config.serve.route_around)
    return engine, tokenizer


class ServeWorker(Service):
    name = "serve_worker"

    def __init__(self, config: FlashMoEConfig, store: str, cache_endpoint: str,
                 events: str | None, predictor_control: str | None, runtime_dir: Path | None,
                 control_endpoint: str | None = None) -> None:
        import uvicorn

        super().__init__(config, control_endpoint)
        self.store, self.cache_endpoint, self.events = store, cache_endpoint, events
        host, port = config.serve.host, config.serve.port
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self.listening = socket.create_server((host, port), family=family)
        except OSError as exc:
            raise CannotListen(f"cannot listen on {host}:{port}: {exc.strerror} (set "
                               f"serve.port; 0 = any free port)") from None
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.listening.getsockname()[1]}"
        if host not in ("127.0.0.1", "::1", "localhost") and not config.serve.api_key:
            self.log.warning("listening on %s without serve.api_key: anyone who can reach it "
                             "can use the model", host)
        cache_control = control_endpoint_for(cache_endpoint)
        self.serving = ServingState(
            model_name(config, store), config.serve.api_key,
            cache_stats=lambda: control_stats(cache_control, timeout_s=STATS_TIMEOUT_S),
            predictor_stats=(lambda: control_stats(predictor_control, timeout_s=STATS_TIMEOUT_S))
            if predictor_control else dict,
            metrics=RequestMetrics(),
            allowed_hosts=allowed_hosts(config.serve.allowed_hosts, config.serve.host))
        self.info = runtime_dir / INFO_FILE if runtime_dir is not None else None
        self.server = uvicorn.Server(uvicorn.Config(make_app(self.serving), log_level="warning",
                                                    access_log=False, lifespan="off"))
        self.http = threading.Thread(target=self.server.run, kwargs={"sockets": [self.listening]},
                                     name="api-http", daemon=True)
        self.loader = threading.Thread(target=self.load, name="model-loader", daemon=True)
        self.connection: Connection | None = None
        self.publisher: EventPublisher | None = None
        self.engine: Engine | None = None

    def banner(self) -> str:
        return f"serving {self.serving.model_name} ({self.store}) on {self.url}"

    def load(self) -> None:
        try:
            if self.events:
                self.publisher = EventPublisher(self.config, self.events,
                                                f"serve[{os.getpid()}]")
            self.connection = Connection(self.cache_endpoint, self.config,
                                         store_model_shape(self.store))
            engine, tokenizer = build_engine(self.config, self.store, self.connection,
                                             self.publisher)
            engine.start()
            self.engine = engine
            self.serving.tokenizer = tokenizer
            self.serving.engine = engine
            self.log.info("model loaded: %s, %d MoE layers, context %d; API on %s",
                          type(engine.runner.model).__name__, len(engine.runner.moe_layers),
                          engine.context_length, self.url)
        except Exception as exc:  # noqa: BLE001 - reported, then the process exits
            self.serving.load_error = f"{type(exc).__name__}: {exc}"
            self.log.exception("the model cannot be served")

    def serve(self) -> None:
        self.http.start()
        if self.info is not None:  # the user's alone from the start, as the runtime folder
            fd = os.open(self.info, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as info:
                info.write(json.dumps({"url": self.url, "pid": os.getpid(),
                                       "model": self.serving.model_name}))
        self.loader.start()
        super().serve()

    def on_tick(self, now: float) -> None:
        if not self.http.is_alive():
            raise WebServerStopped("uvicorn's thread ended")
        if self.serving.load_error:
            raise ModelNotLoaded(self.serving.load_error)
        if self.connection is not None and self.connection.unreachable:
            raise ArenaLost(self.connection.unreachable)

    def stats(self) -> dict:
        out = super().stats()
        if self.engine is not None:
            out.update(self.engine.stats)
        return out

    def close_resources(self) -> None:
        self.server.should_exit = True
        if self.engine is not None:
            self.engine.stop()
        if self.http.is_alive():
            self.http.join(5)
        self.listening.close()
        if self.connection is not None:
            self.connection.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.info is not None:
            self.info.unlink(missing_ok=True)


def run_serve_worker(config: FlashMoEConfig, store: str, cache_endpoint: str,
                     events: str | None = None, predictor_control: str | None = None,
                     runtime_dir: Path | None = None,
                     control_endpoint: str | None = None) -> int:
    """Process entry: listen, load the model, serve until SIGTERM/SIGINT."""
    return run_service_process(lambda: ServeWorker(config, store, cache_endpoint, events,
                                                   predictor_control, runtime_dir,
                                                   control_endpoint),
                               ServeWorker.name)
