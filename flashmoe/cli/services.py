"""Commands that run or ask the services: serve-cache, serve-features, serve-predictor,
serve-panel, trace-worker, generate, health."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flashmoe.cli.options import (add_config_flags, add_json, add_trace, add_warmup,
                                  check_warmup, config, csv, non_empty, non_negative_int,
                                  positive_int, trace_of)
from flashmoe.reports import write_json


def cmd_serve_cache(args) -> int:
    from common.bus import control_endpoint_for
    from services.cache_manager.process import run_cache_manager_process

    control = args.control_endpoint or control_endpoint_for(args.endpoint)
    return run_cache_manager_process(config(args, args.store), args.endpoint, control,
                                     args.predictions)


def cmd_serve_features(args) -> int:
    from common.bus import control_endpoint_for
    from services.feature_extractor.process import run_feature_extractor_process

    control = args.control_endpoint or control_endpoint_for(args.endpoint)
    settings = config(args, args.store)
    return run_feature_extractor_process(settings, args.events, args.endpoint, control,
                                         args.warmup, cluster_shape_of(settings),
                                         args.checkpoint_dir)


def cmd_serve_predictor(args) -> int:
    from common.bus import control_endpoint_for
    from services.predictor.process import run_predictor_process

    control = args.control_endpoint or control_endpoint_for(args.endpoint)
    settings = config(args, args.store)
    return run_predictor_process(settings, args.features, args.endpoint, control,
                                 args.checkpoint_dir, args.warmup, cluster_shape_of(settings))


def cluster_shape_of(settings):
    """What the peers' shared values must look like on this device (None without a
    cluster): the extractor's and the predictor's arrays, for the store's model."""
    if not settings.cluster.redis_url:
        return None
    from common.store import ExpertStore
    from flashmoe.sim.learning import cluster_shape

    manifest = ExpertStore.open(settings.store.path).manifest
    return cluster_shape(len(manifest.moe_layers), manifest.num_experts, settings)


def cmd_serve_panel(args) -> int:
    from services.control_panel.process import run_panel_process

    settings = config(args)
    services = dict(item.split("=", 1) for item in args.service)
    return run_panel_process(settings, Path(args.runtime_dir) if args.runtime_dir else None,
                             args.host, settings.panel.port if args.port is None else args.port,
                             services)


def _given_config(args):
    """The config when the command line sets any of it, else None (the service's own)."""
    return config(args) if (args.config or args.set or args.profile) else None


def cmd_trace_worker(args) -> int:
    from services.inference_worker.process import run_trace_worker

    trace = trace_of(args)
    stats = run_trace_worker(_given_config(args), args.cache, trace, args.start, args.tokens,
                             events=args.events, token_ms=args.token_ms, loop=args.loop,
                             compute=args.compute)
    # The manager's counters are missing when it went away at the very end.
    keys = ("n_hit", "n_miss", "n_hit_loading", "n_evict", "n_load", "n_byte_read",
            "tokens_failed", "reconnects")
    print(json.dumps({k: stats.get(k) for k in keys}))
    if stats.get("token_ms"):
        ms = sorted(stats["token_ms"])
        print(f"{len(ms)} tokens, {1e3 * len(ms) / sum(ms):.2f} tokens/s, p50 "
              f"{ms[len(ms) // 2]:.1f} ms")
    if args.json:
        write_json(stats, args.json)
    return 0


def cmd_serve_worker(args) -> int:
    from services.inference_worker.server import run_serve_worker

    return run_serve_worker(config(args, args.store), args.store, args.cache, args.events,
                            args.predictor_control,
                            Path(args.runtime_dir) if args.runtime_dir else None,
                            args.control_endpoint)


# The cache manager's refusal codes that mean the store's bytes are bad.
STORE_LOAD_ERRORS = ("checksum", "io_error")


def cmd_generate(args) -> int:
    import tempfile

    from common.cache_client import ExpertLoadError
    from common.store import StoreError
    from flashmoe.errors import UsageError
    from flashmoe.runtime.launch import Launcher
    from flashmoe.runtime.serve import check_store, learned_state_dir, learning_specs
    from services.inference_worker.api import encode_prompt
    from services.inference_worker.generate import generate, load_tokenizer

    # Every mistake that can be seen here is refused before a process starts.
    settings = config(args, args.store, first=["cache.policy=flashmoe"])
    opened = check_store(args.store)
    if not encode_prompt(load_tokenizer(args.store), args.prompt):
        raise UsageError(f"--prompt {args.prompt!r} gives no tokens with this model's tokenizer")
    check_warmup(args.warmup, settings, opened.manifest)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    with tempfile.TemporaryDirectory(prefix="flashmoe-generate-") as runtime:
        launcher, events, endpoint = None, args.events, args.cache
        if not args.cache:  # the cache manager and the learning path, as `serve` runs them
            launcher = Launcher(settings, Path(runtime))
            events = f"ipc://{runtime}/worker.events.sock"
            state = learned_state_dir(Path(args.home), opened)
            state.mkdir(parents=True, exist_ok=True)
        try:
            if launcher is not None:
                launcher.start_together([(spec.name, spec.command) for spec in learning_specs(
                    args.store, state, events, args.warmup, launcher.endpoint)])
                endpoint = launcher.endpoint("cache_manager")
            try:
                result = generate(args.store, args.prompt, args.max_new_tokens, endpoint,
                                  settings if launcher or args.config or args.set or args.profile
                                  else None, events=events, on_token=show)
            except ExpertLoadError as exc:
                if exc.code not in STORE_LOAD_ERRORS:
                    raise
                raise StoreError(f"{args.store}: {exc}; `flashmoe verify {args.store}` checks "
                                 f"every block, convert the model again to repair it") from None
        finally:
            if launcher is not None:
                launcher.stop_all()
    print()
    s, steps = result["stats"], result["decode_steps"]
    print(f"--\n{len(result['prompt_ids'])} prompt tokens, {len(result['token_ids'])} new "
          f"tokens ({result['finish_reason']}); prefill {result['prefill_s'] * 1000:.0f} ms, "
          f"decode {result['decode_s'] * 1000 / max(steps, 1):.1f} ms/token", file=sys.stderr)
    n = s["n_hit"] + s["n_miss"]
    print(f"cache: {s['policy']}, {s['n_slots']} slots, hit rate {s['n_hit'] / max(n, 1):.3f} "
          f"({s['n_hit']} hits, {s['n_miss']} misses, {s['n_evict']} evictions), "
          f"{s['n_byte_read'] / 2**20:.1f} MiB read, prefetch {s['prefetch_used']}/"
          f"{s['prefetch_issued']} used, engine {s['engine']}, estimate "
          f"{s.get('estimate', 'none')}", file=sys.stderr)
    if args.json:
        write_json(result, args.json)
    return 0


def cmd_health(args) -> int:
    from common.bus import ServiceUnavailable, health

    try:
        reply = health(args.endpoint, timeout_s=args.timeout)
    except ServiceUnavailable as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    print(f"{reply.service} pid {reply.pid}: {reply.state}, up {reply.uptime_s:.1f} s")
    return 0 if reply.state == "running" else 1


def _add_service_endpoints(p: argparse.ArgumentParser, endpoint_help: str,
                           control_help: str | None = None) -> None:
    p.add_argument("--endpoint", required=True, help=endpoint_help)
    p.add_argument("--control-endpoint", help=control_help)


def _add_learning_service(sub, name: str, help: str, inputs: str, inputs_help: str,
                          publishes: str) -> argparse.ArgumentParser:
    """A learning-path service's parser: its store, the PUB endpoints it reads (``inputs``),
    the one it binds for ``publishes`` and its control socket."""
    p = sub.add_parser(name, help=help)
    p.add_argument("store")
    p.add_argument(inputs, type=csv(str), required=True, help=inputs_help)
    _add_service_endpoints(p, f"PUB endpoint to bind for {publishes}")
    return p


def _add_events(p: argparse.ArgumentParser) -> None:
    p.add_argument("--events", help="PUB endpoint to bind for the AccessEvents it publishes")


def register(sub) -> None:
    p = sub.add_parser("serve-cache", help="run the cache manager process")
    p.add_argument("store")
    _add_service_endpoints(p, "ZeroMQ endpoint to bind, e.g. ipc:///x.sock",
                           "control socket (health, stats); default: the endpoint's "
                           "x.control.sock for ipc")
    p.add_argument("--predictions", type=csv(str), default=[],
                   help="the predictor's PUB endpoint(s) to subscribe to")
    add_config_flags(p)
    p.set_defaults(func=cmd_serve_cache)

    p = _add_learning_service(sub, "serve-features", "run the feature extractor process",
                              "--events", "the workers' AccessEvent PUB endpoint(s)",
                              "FeatureBatches")
    p.add_argument("--checkpoint-dir",
                   help="where the feature extractor checkpoints its tables (and resumes from)")
    add_warmup(p, help="start from a warm-up checkpoint's tables (without a checkpoint)")
    add_config_flags(p)
    p.set_defaults(func=cmd_serve_features)

    p = _add_learning_service(sub, "serve-predictor", "run the predictor process", "--features",
                              "the feature extractor's PUB endpoint(s)", "Predictions")
    p.add_argument("--checkpoint-dir", required=True,
                   help="where the predictor checkpoints itself (and resumes from)")
    add_warmup(p, help="a warm-up checkpoint for a first start")
    add_config_flags(p)
    p.set_defaults(func=cmd_serve_predictor)

    p = sub.add_parser("serve-panel", help="run the control panel (web page, JSON API, "
                                           "Prometheus metrics) over the services' control "
                                           "sockets")
    p.add_argument("--runtime-dir", help="the services' runtime folder: every "
                                         "<service>.control.sock in it is asked")
    p.add_argument("--service", action="append", default=[], metavar="NAME=ENDPOINT",
                   help="a service's control endpoint, besides the runtime folder's")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback: the panel retunes services)")
    p.add_argument("--port", type=int, help="TCP port (default panel.port; 0 = any free one)")
    add_config_flags(p)
    p.set_defaults(func=cmd_serve_panel)

    p = sub.add_parser("trace-worker", help="replay a routing trace through a live cache "
                                            "manager, as a worker")
    p.add_argument("--cache", required=True, help="the cache manager's endpoint")
    add_trace(p)
    p.add_argument("--start", type=non_negative_int, default=0,
                   help="first decode step (row) to replay")
    p.add_argument("--tokens", type=positive_int, help="decode steps to replay (default: all)")
    add_json(p, help="write the cache manager's stats at the end")
    _add_events(p)
    p.add_argument("--token-ms", type=float, default=0.0,
                   help="make each decode step last at least this long (a model's pace)")
    p.add_argument("--loop", action="store_true", help="replay the slice again and again "
                                                       "until stopped")
    p.add_argument("--compute", action="store_true",
                   help="run each layer's experts on the fetched weights (real matrix work)")
    add_config_flags(p)
    p.set_defaults(func=cmd_trace_worker)

    p = sub.add_parser("serve-worker", help="run the serving worker: the model behind the "
                                            "OpenAI-compatible API (`flashmoe serve` starts it)")
    p.add_argument("store")
    p.add_argument("--cache", required=True, help="the cache manager's endpoint")
    _add_events(p)
    p.add_argument("--predictor-control", help="the predictor's control endpoint (its figures "
                                               "in /stats)")
    p.add_argument("--runtime-dir", help="where to announce the URL (serve.json)")
    p.add_argument("--control-endpoint", help="answer health and stats there")
    add_config_flags(p)
    p.set_defaults(func=cmd_serve_worker)

    p = sub.add_parser("generate", help="generate text with a store's model, its experts "
                                        "through the cache manager")
    p.add_argument("--store", required=True)
    p.add_argument("--prompt", required=True, type=non_empty)
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--cache", help="a running cache manager's endpoint (default: start one, "
                                   "with the extractor and predictor, for this run)")
    p.add_argument("--home", default=".flashmoe/serve",
                   help="where each store's learned state is kept (as `serve`)")
    add_warmup(p, help="a warm-up checkpoint of this model (default: the state under --home, "
                       "else cold)")
    _add_events(p)
    add_json(p, help="write token ids, text and the cache stats")
    add_config_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("health", help="a health check: one round trip on a service's control "
                                      "socket (exit 0 when it is running)")
    p.add_argument("endpoint", help="the service's control endpoint")
    p.add_argument("--timeout", type=float, default=3.0)
    p.set_defaults(func=cmd_health)
