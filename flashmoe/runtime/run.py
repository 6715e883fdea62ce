"""`flashmoe run`: the whole system as supervised local processes (the embedded default).

The cache manager, the feature extractor, the predictor and a trace-driven worker run as
separate processes over ipc sockets in a private runtime folder (``ipc.runtime_dir`` or a
fresh one, removed at a clean end unless ``--keep-logs``; kept, and its path printed, after a
failure); a supervisor restarts whatever dies (with back-off) and Ctrl-C or SIGTERM stops
everything, leaving no process, socket file or shared-memory arena behind. ``--home`` is locked
for the run (a second instance on it is refused with the first's pid); Ctrl-C during start-up
stops what was started and is one line. A token whose experts fail to load is skipped by the
worker and counted (``tokens_failed`` in the summary); the run goes on.

What it needs is made on first use, under ``--home`` (default ``.flashmoe/run``): a store of
random bf16 experts in gpt-oss-20b's shape (``flashmoe synth-store``, at ``DEFAULT_SCALE``: a
quick store; `flashmoe e2e-bench` makes its own larger one) and a warm-up checkpoint of the
learned policy (``flashmoe warmup`` on the first ``SAMPLE_TRAIN_TOKENS`` tokens of the train split;
none for a ``--store`` of another topology: the learner starts cold).
The worker replays gpt-oss-20b's eval split at a model's pace: the full split where the full
traces are found (``--traces-dir``, ``traces.dir``, ``../shared/traces``), else the sample
committed in the project (``gptoss20b-sample``); the run says which.

A user's store (``--store``) is run with a routing trace of its model's shape (layers, experts,
top-k; ``--trace``, e.g. one made with ``flashmoe trace record``): a trace of another shape is
refused before anything starts, with what to do instead. A warm-up checkpoint of another shape
than the store's (the default one is gpt-oss-20b's) is not used: the learned policy starts
cold, and the run says so. Progress (whole tokens,
tokens/s as the average since the first sample, as in the summary, and over the last second,
hit rate, SSD MB/s, learner CPU) is printed every second, a summary at the end.

The control panel (``services/control_panel``) runs as one more supervised process on
127.0.0.1:``panel.port`` (0: any free port); its URL and token (``panel.token``, else one made
here) are printed once it listens. The token reaches the panel alone, through its environment;
the other services' config does not carry it.

With ``--redis URL`` (``cluster.redis_url``) the feature extractor and the predictor share this
device's pattern features with its peers and start from theirs (common/cluster.py); the
cluster's state (connected, or alone and why) is printed when it changes and in the summary.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from common.bus import ServiceUnavailable, ipc_endpoint, stats
from common.cluster import summary_of_stats
from common.config import ENV_PREFIX, ConfigError, FlashMoEConfig
from common.model_families import SYNTH_SHAPES
from common.service import Interrupted, raising_signals
from common.store import ExpertStore
from common.traces import (SAMPLE_NAME, SAMPLE_TRAIN_TOKENS, Trace, TraceError, find_traces_dir,
                           first_sequences, has_full_traces, load_trace)
from flashmoe.runtime.launch import lock_home, private_runtime_dir
from flashmoe.runtime.supervisor import ServiceSpec, SupervisionError, Supervisor
from flashmoe.tools.synth_store import synth_store

DEFAULT_SCALE = 0.03  # ~1.3 GB of experts: made in well under a minute
PROGRESS_S = 1.0
PANEL_ANNOUNCE_S = 30.0  # how long `run` waits for the panel to say where it listens
WORKER_JSON = "worker.json"  # the trace worker's figures, written as it exits
WORKER_FIGURES = ("tokens_failed", "reconnects")  # of those, what the summary shows


def default_traces(traces_dir: Path) -> tuple[str, str]:
    """The warm-up and replay traces of a run: the full gpt-oss-20b splits when present,
    else the committed sample (the same warm-up tokens, a short eval replay)."""
    if has_full_traces(traces_dir):
        return "gptoss20b:train", "gptoss20b:eval"
    return f"{SAMPLE_NAME}:train", f"{SAMPLE_NAME}:eval"


def store_shape(store: str) -> tuple[int, int, int]:
    """(MoE layers, experts a layer, top-k) of a store's model."""
    manifest = ExpertStore.open(store).manifest
    return len(manifest.moe_layers), manifest.num_experts, manifest.top_k


def shape_text(shape: tuple[int, ...]) -> str:
    return f"{shape[0]} MoE layers x {shape[1]} experts" + \
        (f", top-{shape[2]}" if len(shape) > 2 else "")


def check_trace_fits(trace: Trace, store: str | None) -> None:
    """A replay needs a trace of the store's model (``store`` None: the default store, of
    gpt-oss-20b's shape): else a TraceError that says what to do."""
    if store is None:
        default = SYNTH_SHAPES["gpt-oss-20b"]
        want, where = (default.layers, default.experts, default.top_k), "the default store"
    else:
        want, where = store_shape(store), f"the store {store}"
    got = (trace.num_layers, trace.num_experts, trace.top_k)
    if got != want:
        raise TraceError(
            f"the trace to replay, {trace.name} ({trace.model}: {shape_text(got)}), is not of "
            f"the shape of {where} ({shape_text(want)}); `run` replays a routing trace "
            f"through the store's experts, so it needs one of the store's model: record one "
            f"(`flashmoe trace record --model HF_DIR --prompts PROMPTS.jsonl --out "
            f"TRACE.npz`) and give it with --trace" + (
                f". `flashmoe generate --store {store} --prompt TEXT` runs the model itself."
                if store is not None else ", with the store as --store."))


def warmup_shape(folder: str | Path) -> tuple[int, int] | None:
    """(layers, experts) a warm-up checkpoint was made for; None when unreadable (the
    services then say why they do not use it)."""
    try:
        meta = json.loads((Path(folder) / "extractor.json").read_text())
        return int(meta["L"]), int(meta["E"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def synth_store_made(path: Path, config: FlashMoEConfig) -> bool:
    """Whether ``path`` holds the default store as ``synth_store`` would make it now (it is
    then reused, not made)."""
    try:
        made = json.loads((path / "config.json").read_text())["flashmoe_synthetic"]
        return (made["shape"], made["scale"], made["block_size"], made["parallelism"]) == \
            ("gpt-oss-20b", DEFAULT_SCALE, config.store.block_size, config.store.parallelism)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def prepare(home: Path, config: FlashMoEConfig, store: str | None, warmup: str | None,
            traces_dir: Path, say=print) -> tuple[str, str | None]:
    """The store and warm-up checkpoint to run with, made when missing; no warm-up (None)
    where the one given, or the default gpt-oss-20b one, is of another shape than the
    store's."""
    from flashmoe.sim.learning import warmup as run_warmup
    from flashmoe.sim.learning import warmup_fits

    home.mkdir(parents=True, exist_ok=True)
    if store is None:
        path = home / "store"
        if not synth_store_made(path, config):
            say(f"[run] making a store of gpt-oss-20b's shape at scale {DEFAULT_SCALE} in "
                f"{path} (first use only)")
        store = str(synth_store(path, "gpt-oss-20b", DEFAULT_SCALE, config.store.block_size,
                                config.store.parallelism, show_progress=False).path)
    shape = store_shape(store)[:2]
    if warmup is not None:
        given = warmup_shape(warmup)
        if given not in (None, shape):
            say(f"[run] not using the warm-up {warmup}: it is of {shape_text(given)}, the "
                f"store's model of {shape_text(shape)}; the learned policy starts cold")
            return store, None
        return store, warmup
    default = SYNTH_SHAPES["gpt-oss-20b"]
    if shape != (default.layers, default.experts):
        say(f"[run] no warm-up: the default one is of gpt-oss-20b's shape "
            f"({shape_text((default.layers, default.experts))}), the store's model of "
            f"{shape_text(shape)}; the learned policy starts cold (a warm-up of this model: "
            f"`flashmoe warmup --store {store} --text FILE --out DIR`, then --warmup DIR)")
        return store, None
    path = home / "warmup"
    if not warmup_fits(path, config, shape):
        name = default_traces(traces_dir)[0]
        train = first_sequences(load_trace(name, traces_dir), SAMPLE_TRAIN_TOKENS)
        say(f"[run] warming the learned policy up on {train.n_tokens} tokens of {name} "
            f"(first use only)")
        run_warmup(train, config, path)
    return store, str(path)


def services(store: str, warmup: str | None, runtime: Path, trace: str, tokens: int | None,
             loop: bool, token_ms: float, endpoint,
             traces_dir: Path | None = None) -> list[ServiceSpec]:
    """The processes of a run, in start order; ``endpoint(service)`` names their sockets.
    ``warmup`` None: the learning services start cold."""
    events = f"ipc://{runtime}/worker.events.sock"
    worker = ["trace-worker", "--cache", endpoint("cache_manager"), "--events", events,
              "--trace", trace, "--token-ms", str(token_ms),
              "--json", str(runtime / WORKER_JSON)]
    if traces_dir is not None:
        worker += ["--traces-dir", str(traces_dir)]
    if loop:
        worker.append("--loop")
    elif tokens:
        worker += ["--tokens", str(tokens)]
    warm = ["--warmup", warmup] if warmup is not None else []
    return [
        ServiceSpec("predictor", ["serve-predictor", store, "--features",
                                  endpoint("feature_extractor"), "--checkpoint-dir",
                                  str(runtime / "predictor-checkpoint"), *warm]),
        ServiceSpec("feature_extractor", ["serve-features", store, "--events", events, *warm]),
        ServiceSpec("cache_manager", ["serve-cache", store, "--predictions",
                                      endpoint("predictor")]),
        ServiceSpec("worker", worker, health_checked=False, exits_when_done=not loop,
                    sockets=[events]),
    ]


def panel_spec(runtime: Path, port: int, token: str) -> ServiceSpec:
    """The control panel as a supervised process (no control socket of its own: it is a
    client of the others')."""
    return ServiceSpec("panel", ["serve-panel", "--runtime-dir", str(runtime), "--port",
                                 str(port)],
                       health_checked=False, env={f"{ENV_PREFIX}PANEL__TOKEN": token})


def check_panel_port(port: int) -> None:
    """Fail before anything starts when ``panel.port`` is taken (0 always works)."""
    from services.control_panel.process import listen

    if port == 0:
        return
    try:
        listen("127.0.0.1", port).close()
    except OSError as exc:
        raise ConfigError(f"panel.port = {port}: 127.0.0.1:{port} is not free "
                          f"({exc.strerror}); set another panel.port (0 = any free port)") \
            from None


def wait_panel_url(runtime: Path, timeout_s: float = PANEL_ANNOUNCE_S,
                   exited=lambda: None) -> str | None:
    """The URL the panel announces in ``<runtime>/panel.json`` once it listens; None at
    ``timeout_s``, or at once when ``exited()`` gives the panel's exit status."""
    from services.control_panel.process import INFO_FILE

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and exited() is None:
        try:
            return json.loads((runtime / INFO_FILE).read_text())["url"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    return None


def learner_cpu_by_stage(extractor: dict, predictor: dict) -> dict[str, float]:
    """The learner's CPU ms a token by stage, from the extractor's and predictor's stats."""
    return {"extract": extractor.get("cpu_ms_per_event", 0.0),
            **{k[len("cpu_ms_"):]: v for k, v in predictor.items() if k.startswith("cpu_ms_")}}


@dataclasses.dataclass
class Progress:
    """Figures from the services' control sockets. Tokens are whole decode steps (the cache
    manager's acquires over the layers) since the first sample; ``tokens_per_s`` is their
    average rate since then, in the progress lines and the summary alike (the progress line
    also shows the rate over its last interval)."""
    layers: int
    started: float = dataclasses.field(default_factory=time.monotonic)
    last: dict | None = None
    last_t: float = 0.0
    first: dict | None = None
    first_t: float = 0.0

    def _tokens(self, cache: dict) -> int:
        first = self.first["acquire"] if self.first else cache["n_acquire"]
        return max(cache["n_acquire"] - first, 0) // self.layers

    def _average(self, tokens: int) -> float:
        elapsed = self.last_t - self.first_t
        return tokens / elapsed if elapsed > 0 else 0.0

    def sample(self, cache: dict, extractor: dict, predictor: dict) -> dict:
        now = time.monotonic()
        current = {"acquire": cache["n_acquire"], "hit": cache["n_hit"], "miss": cache["n_miss"],
                   "bytes": cache["n_byte_read"], "prefetch_used": cache["prefetch_used"],
                   "prefetch_issued": cache["prefetch_issued"]}
        if self.first is None:
            self.first, self.first_t = current, now
        window = now - self.last_t if self.last is not None else 0.0
        previous, dt = self.last or current, max(window, 1e-9)
        self.last, self.last_t = current, now
        delta = {k: current[k] - previous[k] for k in current}
        accesses = delta["hit"] + delta["miss"]
        tokens = self._tokens(cache)
        return {"tokens": tokens, "tokens_per_s": self._average(tokens),
                "recent_tokens_per_s": max(delta["acquire"], 0) / self.layers / dt,
                "window_s": window,
                "hit_rate": delta["hit"] / accesses if accesses else float("nan"),
                "ssd_mb_per_s": delta["bytes"] / dt / 1e6,
                "learner_cpu_ms_per_token": sum(learner_cpu_by_stage(extractor,
                                                                     predictor).values()),
                "estimate": cache.get("estimate", "?")}

    def summary(self, cache: dict, extractor: dict, predictor: dict) -> dict:
        wall = time.monotonic() - self.started
        stages = learner_cpu_by_stage(extractor, predictor)
        tokens = self._tokens(cache)
        hits, misses = cache["n_hit"], cache["n_miss"]
        return {"tokens": tokens, "wall_s": round(wall, 1),
                "tokens_per_s": round(self._average(tokens), 2),
                "hit_rate": round(hits / max(hits + misses, 1), 4),
                "stall_free_rate": round(hits / max(hits + misses, 1), 4),
                "n_hit_loading": cache["n_hit_loading"],
                "ssd_bytes": cache["n_byte_read"], "prefetch_issued": cache["prefetch_issued"],
                "prefetch_used": cache["prefetch_used"],
                "prefetch_wasted": cache["prefetch_wasted"], "engine": cache["engine"],
                "policy": cache["policy"],
                "learner_cpu_ms_per_token": round(sum(stages.values()), 3),
                "learner_cpu_ms_by_stage": stages,
                "predictor_drifts": predictor.get("drifts"),
                "variance_kept": extractor.get("variance_kept"),
                **({"cluster": {"feature_extractor": summary_of_stats(extractor),
                                "predictor": summary_of_stats(predictor)}}
                   if "cluster_state" in predictor else {})}


def run(config: FlashMoEConfig, home: Path, store: str | None = None, warmup: str | None = None,
        trace: str | None = None, tokens: int | None = 200, loop: bool = False,
        token_ms: float = 0.0, traces_dir: Path | None = None, keep_logs: bool = False,
        out=sys.stdout) -> dict:
    """Run every service until ``tokens`` are replayed (``loop``: until stopped). ``trace``:
    the routing the worker replays (default: gpt-oss-20b's eval split, full or sample).
    ``home`` is locked for the run (``HomeInUse`` when another instance holds it). SIGTERM or
    SIGINT during set-up raise ``Interrupted`` once what was started is stopped; after it they
    end the run with its summary. The runtime folder goes at the end unless ``keep_logs`` or
    the run failed (then its path is printed)."""
    say = lambda text: print(text, file=out, flush=True)  # noqa: E731
    from services.control_panel.process import INFO_FILE

    stop = {"requested": False}

    def request_stop(*_args):
        stop["requested"] = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    lock = supervisor = runtime = None
    own_runtime = not config.ipc.runtime_dir
    failed = True
    try:
        with raising_signals(lambda: stop["requested"]):
            check_panel_port(config.panel.port)
            traces_dir = find_traces_dir(traces_dir, config.traces.dir)
            if trace is None:
                trace = default_traces(traces_dir)[1]
                say(f"[run] replaying {trace}: " + (
                    f"the full eval split from {traces_dir}" if trace.startswith("gptoss20b:")
                    else f"the sample committed in the project (the full traces are not in "
                         f"{traces_dir}; give their folder with --traces-dir or traces.dir)"))
            replayed = load_trace(trace, traces_dir)
            check_trace_fits(replayed, store)  # before anything is made or started
            lock = lock_home(home, "run")
            store, warmup = prepare(home, config, store, warmup, traces_dir, say)
            runtime, token, config = instance_config(config, store, "run")
            specs = services(store, warmup, runtime, trace, tokens, loop, token_ms,
                             lambda service: ipc_endpoint(runtime, service), traces_dir)
            specs.append(panel_spec(runtime, config.panel.port, token))
            (runtime / INFO_FILE).unlink(missing_ok=True)
            supervisor = Supervisor(config, runtime, specs)
            say(f"[run] runtime folder {runtime}; logs: {runtime}/<service>.log")
            supervisor.start_all()
            say(f"[run] services up: {supervisor.pids()}")
            url = wait_panel_url(runtime, exited=lambda: supervisor.exited("panel"))
            say(f"[run] control panel {url}  token {token}" if url else
                f"[run] the control panel did not start; see {runtime}/panel.log")
        progress = Progress(replayed.num_layers)
        endpoints = {name: supervisor.control_endpoint(name)
                     for name in ("cache_manager", "feature_extractor", "predictor")}
        latest = None
        cluster_state = None
        while not stop["requested"] and not supervisor.done:
            for message in supervisor.poll():
                say(f"[run] {message}")
            try:
                snapshot = {name: stats(endpoint, timeout_s=2.0)
                            for name, endpoint in endpoints.items()}
            except ServiceUnavailable:
                time.sleep(PROGRESS_S)
                continue
            latest = snapshot
            link = summary_of_stats(snapshot["predictor"])
            if link and (link["state"], link["reason"]) != cluster_state:
                cluster_state = (link["state"], link["reason"])
                say(f"[run] cluster {link['state']} (device {link['device']}, {link['peers']} "
                    f"peers){': ' + link['reason'] if link['reason'] else ''}")
            p = progress.sample(snapshot["cache_manager"], snapshot["feature_extractor"],
                                snapshot["predictor"])
            recent = f" (last {p['window_s']:.0f} s: {p['recent_tokens_per_s']:.2f})" \
                if p["window_s"] else ""
            say(f"[run] {p['tokens']:8d} tokens  {p['tokens_per_s']:6.2f} tok/s{recent}  hit "
                f"{p['hit_rate']:.3f}  SSD {p['ssd_mb_per_s']:7.1f} MB/s  learner "
                f"{p['learner_cpu_ms_per_token']:.2f} ms/tok  estimate {p['estimate']}")
            time.sleep(PROGRESS_S)
        supervisor.stop()  # the worker writes its figures as it exits
        summary = progress.summary(latest["cache_manager"], latest["feature_extractor"],
                                   latest["predictor"]) if latest else {}
        summary.update(worker_figures(runtime))
        summary["restarts"] = supervisor.restarts()
        failed = False
        return summary
    except Interrupted:
        failed = False  # stopped by the user: nothing to look into
        raise
    except SupervisionError as exc:
        say(f"[run] stopping: {exc}")
        raise
    finally:
        if supervisor is not None:
            supervisor.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if runtime is not None:
            end_runtime(runtime, own_runtime, keep_logs or failed, say, "run")
        if lock is not None:
            lock.close()


def instance_config(config: FlashMoEConfig, store: str, command: str
                    ) -> tuple[Path, str, FlashMoEConfig]:
    """The runtime folder (``ipc.runtime_dir`` made private, else a fresh one), the panel's
    token (``panel.token``, else a new one) and the config the services get (the store's
    path; no token: it reaches the panel alone)."""
    from services.control_panel.process import new_token

    runtime = private_runtime_dir(Path(config.ipc.runtime_dir)) if config.ipc.runtime_dir \
        else Path(tempfile.mkdtemp(prefix=f"flashmoe-{command}-"))
    token = config.panel.token or new_token()
    return runtime, token, dataclasses.replace(
        config, store=dataclasses.replace(config.store, path=store),
        panel=dataclasses.replace(config.panel, token=""))


def worker_figures(runtime: Path) -> dict:
    """The trace worker's own counts (``WORKER_FIGURES``, from the file it writes as it
    exits); {} when it wrote none (killed)."""
    try:
        figures = json.loads((runtime / WORKER_JSON).read_text())
    except (OSError, ValueError):
        return {}
    return {key: figures[key] for key in WORKER_FIGURES if key in figures}


def end_runtime(runtime: Path, own: bool, keep: bool, say, command: str) -> None:
    """A run's runtime folder at its end: kept (and its path printed) when ``keep``, else
    removed when the run made it; a given ``ipc.runtime_dir`` stays, its socket files gone."""
    if keep:
        say(f"[{command}] logs kept in {runtime}")
    elif own:
        shutil.rmtree(runtime, ignore_errors=True)


def format_summary(summary: dict) -> str:
    return "\n".join(f"{key:<26} {value}" for key, value in summary.items())
