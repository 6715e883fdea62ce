"""`flashmoe serve STORE`: a converted model behind an OpenAI-compatible API, the learned
cache live.

The processes of `flashmoe run` under the same supervisor (cache manager, feature extractor,
predictor, control panel), with the serving worker (services/inference_worker/server.py) in
place of the trace replay: it loads the model's non-expert weights once and answers
``/v1/completions`` and ``/v1/chat/completions`` on ``serve.host:serve.port``. Its decode
steps feed the extractor and the predictor, whose estimates drive the FlashMoE policy and
its look-ahead prefetch.

The learned state lives under ``--home``, one folder per store (``learned_state_dir``): the
predictor's checkpoint and the extractor's tables, resumed on the next start. A model never
seen starts cold; ``--warmup`` (a checkpoint of this model's shape, `flashmoe warmup --store
STORE --text FILE`) starts it warm. The store itself is only read. Ctrl-C or SIGTERM stop
everything and leave no process, socket file, arena or runtime folder behind (``--keep-logs``,
or a failure, keeps the folder and prints its path). ``--home`` is locked while it serves: a
second instance on it is refused with the first's pid.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from common.bus import control_endpoint_for, ipc_endpoint
from common.config import ConfigError, FlashMoEConfig
from common.service import Interrupted, raising_signals
from common.store import CONFIG_NAME, ExpertStore, StoreError
from flashmoe.runtime.launch import lock_home
from flashmoe.runtime.run import (check_panel_port, end_runtime, instance_config, panel_spec,
                                  wait_panel_url)
from flashmoe.runtime.supervisor import ServiceSpec, SupervisionError, Supervisor

READY_TIMEOUT_S = 600.0  # loading a large model's non-expert weights takes a while
PROGRESS_S = 10.0


def check_store(store: str | Path) -> ExpertStore:
    """The converted store at ``store``; a Hugging Face checkpoint folder is refused with the
    command that converts it."""
    path = Path(store)
    try:
        return ExpertStore.open(path)
    except StoreError:
        if (path / CONFIG_NAME).is_file() and any(path.glob("*.safetensors")):
            raise StoreError(f"{path} is a Hugging Face checkpoint folder, not a FlashMoE "
                             f"store: convert it first with `flashmoe convert {path} "
                             f"STORE`, then serve STORE") from None
        raise


def learned_state_dir(home: Path, store: ExpertStore) -> Path:
    """Where a store's learned state is kept: ``<home>/stores/<name>-<hash of its path>``."""
    path = store.path.resolve()
    key = hashlib.sha256(str(path).encode()).hexdigest()[:10]
    return home / "stores" / f"{path.name}-{key}"


def learning_specs(store: str, state: Path, events: str, warmup: str | None,
                   endpoint) -> list[ServiceSpec]:
    """Predictor, extractor and cache manager for a model's own routing (``events``: the
    worker's AccessEvents), their state in ``state``."""
    warm = ["--warmup", warmup] if warmup else []
    return [
        ServiceSpec("predictor", ["serve-predictor", store, "--features",
                                  endpoint("feature_extractor"), "--checkpoint-dir",
                                  str(state / "predictor"), *warm]),
        ServiceSpec("feature_extractor", ["serve-features", store, "--events", events,
                                          "--checkpoint-dir", str(state / "extractor"),
                                          *warm]),
        ServiceSpec("cache_manager", ["serve-cache", store, "--predictions",
                                      endpoint("predictor")]),
    ]


def check_port(host: str, port: int, setting: str) -> None:
    import socket

    if port == 0:
        return
    try:
        socket.create_server((host, port)).close()
    except OSError as exc:
        raise ConfigError(f"{setting} = {port}: {host}:{port} is not free ({exc.strerror}); "
                          f"set another {setting} (0 = any free port)") from None


def wait_ready(supervisor: Supervisor, runtime: Path, stop: dict, say,
               timeout_s: float = READY_TIMEOUT_S) -> str | None:
    """The API's URL once ``/health`` answers 200 (None when stopped first)."""
    from services.inference_worker.server import INFO_FILE

    deadline = time.monotonic() + timeout_s
    url = None
    while time.monotonic() < deadline and not stop["requested"]:
        for message in supervisor.poll():
            say(f"[serve] {message}")
        if url is None:
            try:
                url = json.loads((runtime / INFO_FILE).read_text())["url"]
            except (OSError, ValueError, KeyError):
                pass
        if url is not None:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return url
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.2)
    if stop["requested"]:
        return None
    raise SupervisionError(f"the model was not ready within {timeout_s:g} s; see "
                           f"{runtime}/worker.log")


def serve(config: FlashMoEConfig, store: str, home: Path, warmup: str | None = None,
          keep_logs: bool = False, out=sys.stdout) -> dict:
    """Serve until Ctrl-C or SIGTERM; returns the last /stats. ``home`` is locked while it
    serves (``HomeInUse``); a signal during set-up raises ``Interrupted`` once what was started
    is stopped. The runtime folder goes at the end unless ``keep_logs`` or a failure."""
    say = lambda text: print(text, file=out, flush=True)  # noqa: E731
    from services.control_panel.process import INFO_FILE as PANEL_INFO
    from services.inference_worker.server import model_name

    stop = {"requested": False}

    def request_stop(*_args):
        stop["requested"] = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    lock = supervisor = runtime = None
    own_runtime = not config.ipc.runtime_dir
    failed = True
    last: dict = {}
    try:
        with raising_signals(lambda: stop["requested"]):
            lock = lock_home(home, "serve")
            opened = check_store(store)
            check_port(config.serve.host, config.serve.port, "serve.port")
            check_panel_port(config.panel.port)
            store = str(opened.path)
            state = learned_state_dir(home, opened)
            state.mkdir(parents=True, exist_ok=True)
            fresh = not any(state.iterdir())
            runtime, token, config = instance_config(config, store, "serve")
            events = f"ipc://{runtime}/worker.events.sock"
            endpoint = lambda service: ipc_endpoint(runtime, service)  # noqa: E731
            specs = learning_specs(store, state, events, warmup, endpoint)
            specs.append(panel_spec(runtime, config.panel.port, token))
            specs.append(ServiceSpec("worker", [
                "serve-worker", store, "--cache", endpoint("cache_manager"), "--events", events,
                "--predictor-control", control_endpoint_for(endpoint("predictor")),
                "--runtime-dir", str(runtime)], health_checked=False, sockets=[events]))
            supervisor = Supervisor(config, runtime, specs)
            how = ("cold: a model not seen before" if fresh and not warmup else
                   "resumed" if not fresh else "warm-up " + warmup)
            say(f"[serve] {model_name(config, store)}: learned state in {state} ({how})")
            say(f"[serve] runtime folder {runtime}; logs: {runtime}/<service>.log")
            supervisor.start_all()
        url = wait_ready(supervisor, runtime, stop, say)
        if url is not None:
            panel = wait_panel_url(runtime, exited=lambda: supervisor.exited("panel"))
            say(f"[serve] control panel {panel}  token {token}" if panel else
                f"[serve] the control panel did not start; see {runtime}/panel.log")
            say(f"[serve] OpenAI-compatible API on {url}/v1 (model "
                f"{model_name(config, store)!r}); Ctrl-C stops")
        next_progress = time.monotonic() + PROGRESS_S
        shown = None
        while url is not None and not stop["requested"]:
            for message in supervisor.poll():
                say(f"[serve] {message}")
            if time.monotonic() >= next_progress:
                next_progress = time.monotonic() + PROGRESS_S
                last = fetch_stats(url) or last
                line = progress_line(last)
                if line and line != shown:
                    say(f"[serve] {line}")
                    shown = line
            time.sleep(0.2)
        failed = False
        return last
    except Interrupted:
        failed = False  # stopped by the user: nothing to look into
        raise
    except SupervisionError as exc:
        say(f"[serve] stopping: {exc}")
        raise
    finally:
        if supervisor is not None:
            supervisor.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if runtime is not None:
            (runtime / PANEL_INFO).unlink(missing_ok=True)
            end_runtime(runtime, own_runtime, keep_logs or failed, say, "serve")
        if lock is not None:
            lock.close()


def fetch_stats(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/stats", timeout=5) as reply:
            return json.loads(reply.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def progress_line(s: dict) -> str | None:
    if not s.get("requests"):
        return None
    hit = s.get("hit_rate")
    around = s.get("experts_routed_around") or 0
    return (f"{s['requests']} requests, {s['tokens_generated']} tokens generated; cache hit "
            f"{hit if hit is not None else '-'}, estimate {s.get('estimate', '?')}, "
            f"{s.get('estimates_used', 0)} decisions on it" +
            (f"; DEGRADED: {around} expert(s) with a bad block routed around (GET /health "
             f"names them; run `flashmoe verify` on the store)" if around else ""))
