"""The `flashmoe` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.config import ConfigError, describe_fields, load_config
from common.model_families import UnsupportedModelError
from common.safetensors_io import SafetensorsError
from common.store import StoreError
from common.traces import DEFAULT_TRACES_DIR, TraceError
from flashmoe.sim.device_model import DEVICES as DEVICE_NAMES
from flashmoe.errors import CheckpointError
from flashmoe.reports import write_json
from services.cache_manager.policies import PolicyError

USER_ERRORS = (StoreError, ConfigError, UnsupportedModelError, SafetensorsError, FileNotFoundError,
               TraceError, PolicyError, CheckpointError)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", choices=("8gb", "16gb", "32gb"), help="device profile defaults")
    p.add_argument("--config", metavar="FILE", help="TOML or JSON config file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable); see `flashmoe config`")
    p.add_argument("--redis", metavar="URL", help="share pattern features with the devices of "
                   "a cluster through this Redis (cluster.redis_url; see `flashmoe config "
                   "--fields` for AUTH and TLS)")


def _save(args, doc: dict, plot=None) -> None:
    """A report's --json (and, given its plot function, --plot) files, each announced."""
    if args.json:
        write_json(doc, args.json)
        print(f"wrote {args.json}")
    if plot is not None and args.plot:
        plot(doc, args.plot)
        print(f"wrote {args.plot}")


def _overrides(args) -> list[str]:
    """``--set`` items, after the ones the shorthand flags make."""
    return ([f"cluster.redis_url={args.redis}"] if args.redis else []) + list(args.set)


def _config(args, store: str | None = None):
    overrides = _overrides(args)
    if store:
        overrides.insert(0, f"store.path={store}")
    return load_config(profile=args.profile, file=args.config, overrides=overrides)


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def cmd_convert(args) -> int:
    from flashmoe.tools.convert import convert_checkpoint

    overrides = list(args.set)
    if args.block_size:
        overrides.append(f"store.block_size={args.block_size}")
    if args.parallelism:
        overrides.append(f"store.parallelism={args.parallelism}")
    config = load_config(profile=args.profile, file=args.config, overrides=overrides)
    manifest = convert_checkpoint(args.hf_dir, args.store, block_size=config.store.block_size,
                                  parallelism=config.store.parallelism,
                                  show_progress=not args.quiet)
    total = sum(e.nbytes for e in manifest.experts)
    print(f"{args.store}: {manifest.model_family}, {len(manifest.moe_layers)} MoE layers x "
          f"{manifest.num_experts} experts, {total / 2**20:.1f} MiB of experts in "
          f"{len(manifest.block_crc)} blocks of {manifest.block_size // 1024} KiB over "
          f"{manifest.parallelism} stripes")
    return 0


def cmd_generate(args) -> int:
    import tempfile

    from flashmoe.runtime.launch import Launcher
    from services.inference_worker.generate import generate

    config = _config(args, args.store)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    with tempfile.TemporaryDirectory(prefix="flashmoe-generate-") as runtime:
        launcher = None if args.cache else Launcher(config, Path(runtime))
        try:
            endpoint = args.cache or launcher.start("cache", ["serve-cache", args.store]).endpoint
            result = generate(args.store, args.prompt, args.max_new_tokens, endpoint,
                              config if launcher or args.config or args.set or args.profile
                              else None, events=args.events, on_token=show)
        finally:
            if launcher is not None:
                launcher.stop_all()
    s, steps = result["stats"], result["decode_steps"]
    print(f"\n--\n{len(result['prompt_ids'])} prompt tokens, {len(result['token_ids'])} new "
          f"tokens; prefill {result['prefill_s'] * 1000:.0f} ms, decode "
          f"{result['decode_s'] * 1000 / max(steps, 1):.1f} ms/token", file=sys.stderr)
    n = s["n_hit"] + s["n_miss"]
    print(f"cache: {s['policy']}, {s['n_slots']} slots, hit rate {s['n_hit'] / max(n, 1):.3f} "
          f"({s['n_hit']} hits, {s['n_miss']} misses, {s['n_evict']} evictions), "
          f"{s['n_byte_read'] / 2**20:.1f} MiB read, prefetch {s['prefetch_used']}/"
          f"{s['prefetch_issued']} used, engine {s['engine']}", file=sys.stderr)
    if args.json:
        write_json(result, args.json)
    return 0


def cmd_synth_store(args) -> int:
    from flashmoe.tools.synth_store import synth_store

    overrides = list(args.set)
    if args.block_size:
        overrides.append(f"store.block_size={args.block_size}")
    if args.parallelism:
        overrides.append(f"store.parallelism={args.parallelism}")
    config = load_config(profile=args.profile, file=args.config, overrides=overrides)
    from flashmoe.tools.synth_store import DEFAULT_SCALE

    scale = DEFAULT_SCALE if args.scale is None else args.scale
    store = synth_store(args.store, args.shape, scale, config.store.block_size,
                        config.store.parallelism, seed=args.seed, show_progress=not args.quiet)
    total = sum(e.nbytes for e in store.manifest.experts)
    print(f"{args.store}: {args.shape} at scale {scale}, {len(store.keys())} experts of "
          f"{store.manifest.max_expert_bytes / 1e6:.2f} MB, {total / 1e9:.2f} GB in all")
    return 0


def cmd_verify(args) -> int:
    from tqdm import tqdm

    from common.store import ExpertStore

    store = ExpertStore.open(args.store)
    total = sum(e.nbytes for e in store.manifest.experts)
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=args.quiet) as bar:
        for error in store.verify(progress=bar.update):
            print(f"{args.store}: {error}", file=sys.stderr)
            return 1
    print(f"{args.store}: {len(store.manifest.block_crc)} blocks OK")
    return 0


def cmd_io_bench(args) -> int:
    from flashmoe.bench import io as io_bench

    extra = {}
    if args.with_manager:
        from functools import partial

        from flashmoe.bench.prefetch_stream import manager_prefetch_stream

        extra["manager-prefetch"] = partial(manager_prefetch_stream, args.store)
    results = io_bench.io_bench(args.store, args.engine, args.depth, repeat=args.repeat,
                                with_fio=not args.no_fio, extra=extra)
    print(io_bench.format_table(results))
    _save(args, io_bench.report(results, args.store))
    return 0


def cmd_acquire_bench(args) -> int:
    from flashmoe.bench import acquire as acquire_bench

    result = acquire_bench.acquire_bench(args.store, iterations=args.iterations,
                                         engine=args.engine, rounds=args.rounds)
    print(acquire_bench.format_table(result))
    _save(args, result)
    return 0


def cmd_serve_cache(args) -> int:
    from common.bus import control_endpoint_for
    from services.cache_manager.process import run_cache_manager_process

    control = args.control_endpoint or control_endpoint_for(args.endpoint)
    return run_cache_manager_process(_config(args, args.store), args.endpoint, control,
                                     args.predictions)


def cmd_serve_features(args) -> int:
    from common.bus import control_endpoint_for
    from services.feature_extractor.process import run_feature_extractor_process

    control = args.control_endpoint or control_endpoint_for(args.endpoint)
    return run_feature_extractor_process(_config(args, args.store), args.events, args.endpoint,
                                         control, args.warmup)


def cmd_serve_predictor(args) -> int:
    from common.bus import control_endpoint_for
    from services.predictor.process import run_predictor_process

    control = args.control_endpoint or control_endpoint_for(args.endpoint)
    return run_predictor_process(_config(args, args.store), args.features, args.endpoint,
                                 control, args.checkpoint_dir, args.warmup)


def cmd_serve_panel(args) -> int:
    from services.control_panel.process import run_panel_process

    config = _config(args)
    services = dict(item.split("=", 1) for item in args.service)
    return run_panel_process(config, Path(args.runtime_dir) if args.runtime_dir else None,
                             args.host, config.panel.port if args.port is None else args.port,
                             services)


def cmd_build_helper(args) -> int:
    from common.cbuild import BuildError
    from services.cache_manager.io_engine import build_helper
    from services.predictor import fast_infer

    try:  # the predictor's fused inference (without it, the numpy path runs)
        print(fast_infer.build(force=args.force))
    except BuildError as exc:
        print(f"warning: {exc}", file=sys.stderr)
    print(build_helper(force=args.force))
    return 0


def cmd_make_tiny_model(args) -> int:
    from flashmoe.tools.tiny_models import build_tiny_model

    out = build_tiny_model(args.family, args.out, seed=args.seed, layers=args.layers,
                           experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                           expert_intermediate=args.expert_intermediate)
    print(out)
    return 0


def cmd_bench(args) -> int:
    from common.traces import load_trace
    from flashmoe.sim import replay as simulator
    from flashmoe.sim.device_model import DEVICES, shape_for_trace

    trace = load_trace(args.trace, Path(args.traces_dir))
    shape = shape_for_trace(trace, args.model, args.expert_bytes)
    report = simulator.run_bench(trace, args.scope, args.capacity, args.policies,
                                 DEVICES[args.device], shape, mode=args.mode, jobs=args.jobs,
                                 progress=False if args.quiet else None, config=_config(args),
                                 warmup=args.warmup, prefetch=args.prefetch,
                                 stale_tokens=args.stale_tokens)
    print(simulator.format_table(report))
    _save(args, report, simulator.plot)
    return 0


def cmd_warmup(args) -> int:
    from tqdm import tqdm

    from common.traces import load_trace
    from flashmoe.sim.learning import warmup

    if args.text:
        from flashmoe.tools.text_warmup import warmup_from_text

        if not args.store:
            print("flashmoe warmup --text needs --store (the model that reads the text)",
                  file=sys.stderr)
            return 2
        summary = warmup_from_text(args.store, args.text, args.out, _config(args, args.store),
                                   max_tokens=args.max_tokens, passes=args.passes)
        print(json.dumps(summary))
        print(f"wrote {args.out}")
        return 0
    trace = load_trace(args.trace, Path(args.traces_dir))
    with tqdm(total=trace.n_tokens * args.passes, unit="tok", desc="warmup",
              disable=True if args.quiet else None) as bar:
        summary = warmup(trace, _config(args), args.out, progress=bar.update,
                         passes=args.passes)
    print(json.dumps(summary))
    print(f"wrote {args.out}")
    return 0


def cmd_trace_record(args) -> int:
    from flashmoe.tools.trace_record import record_trace

    trace = record_trace(args.model, args.prompts, args.out, max_new_tokens=args.max_new_tokens)
    print(f"{args.out}: {trace.n_sequences} sequences, {trace.n_tokens} decode tokens, "
          f"{trace.num_layers} MoE layers x top-{trace.top_k} of {trace.num_experts} experts")
    return 0


def cmd_trace_worker(args) -> int:
    from common.traces import load_trace
    from services.inference_worker.process import run_trace_worker

    trace = load_trace(args.trace, Path(args.traces_dir))
    config = _config(args) if (args.config or args.set or args.profile) else None
    stats = run_trace_worker(config, args.cache, trace, args.start, args.tokens,
                             events=args.events, token_ms=args.token_ms, loop=args.loop,
                             compute=args.compute)
    keys = ("n_hit", "n_miss", "n_hit_loading", "n_evict", "n_load", "n_byte_read")
    print(json.dumps({k: stats[k] for k in keys}))
    if stats["token_ms"]:
        ms = sorted(stats["token_ms"])
        print(f"{len(ms)} tokens, {1e3 * len(ms) / sum(ms):.2f} tokens/s, p50 "
              f"{ms[len(ms) // 2]:.1f} ms")
    if args.json:
        write_json(stats, args.json)
    return 0


def cmd_bus_bench(args) -> int:
    import tempfile

    from common.traces import load_trace
    from flashmoe.bench import bus as bus_bench
    from flashmoe.tools.synth_store import synth_store

    trace = load_trace(args.trace, Path(args.traces_dir))
    with tempfile.TemporaryDirectory(prefix="flashmoe-busbench-store-") as scratch:
        store = args.store or str(synth_store(Path(scratch) / "store", "gpt-oss-tiny", 1.0,
                                              8192, 3, show_progress=False).path)
        report = {"trace": trace.name, "raw": bus_bench.raw_throughput(trace, args.events),
                  "pipeline": bus_bench.pipeline_throughput(
                      trace, store, args.rates, args.seconds,
                      load_config(profile=args.profile, file=args.config,
                                  overrides=[f"store.path={store}", *args.set]))}
    print(bus_bench.format_table(report))
    _save(args, report)
    return 0


def cmd_task_shift(args) -> int:
    from common.traces import load_trace
    from flashmoe.bench import learning_report
    from flashmoe.sim.device_model import DEVICES, MODEL_SHAPES
    from flashmoe.sim.replay import capacity_for

    trace = load_trace(args.trace, Path(args.traces_dir))
    report = learning_report.task_shift(
        trace, capacity_for(args.capacity, trace, "global"), DEVICES[args.device],
        MODEL_SHAPES[trace.model], _config(args), args.warmup, args.window, args.after)
    for variant, curves in report["curves"].items():
        print(variant, {p: c["hit_rate"] for p, c in curves.items()})
    for row in report["drift"]:
        print(f"after the switch to {row['dataset']} at token {row['token']}: FlashMoE "
              f"{row['with_drift']:.4f} with drift handling, {row['without_drift']:.4f} without")
    _save(args, report, learning_report.plot_task_shift)
    return 0


def cmd_learning_report(args) -> int:
    import dataclasses

    from common.traces import load_trace
    from flashmoe.bench import learning_report
    from flashmoe.sim import replay as simulator
    from flashmoe.sim.device_model import DEVICES, MODEL_SHAPES
    from flashmoe.sim.learning import Learning
    from services.predictor import fast_infer

    trace = load_trace(args.trace, Path(args.traces_dir))
    config = _config(args)
    recall = learning_report.recall_report(load_trace(args.warmup_trace, Path(args.traces_dir)),
                                           trace, config, args.warmup)
    learning = Learning.create(trace.num_layers, trace.num_experts, trace.top_k, config)
    if args.warmup:
        learning.load(args.warmup)
    precision = learning_report.precision_report(learning)
    hit_rates = {}
    variants = {f"heads_{p}": {"infer_precision": p} for p in fast_infer.PRECISIONS}
    if config.predictor.model == "lstm":
        variants["torch_int8_lstm"] = {"int8": True}
    for name, change in variants.items():
        variant = dataclasses.replace(config, predictor=dataclasses.replace(config.predictor,
                                                                            **change))
        report = simulator.run_bench(trace, "global", args.capacity, ["flashmoe"],
                                     DEVICES["orin-980pro"], MODEL_SHAPES[trace.model],
                                     progress=False, config=variant, warmup=args.warmup)
        hit_rates[name] = {
            r["capacity"]: {"hit_rate": r["hit_rate"], "cpu_ms_per_token": r["cpu_ms_per_token"]}
            for r in report["results"]}
    doc = {"trace": trace.name, "warmup": Path(args.warmup).name if args.warmup else None,
           "model": config.predictor.model, "recall_at_k": recall,
           "precision": {**precision, "bench": hit_rates}}
    for name, entry in recall.items():
        print(f"recall@{trace.top_k} {name}: {entry['mean']:.3f}")
    print(json.dumps(doc["precision"], indent=1))
    _save(args, doc)
    return 0


def cmd_learner_cpu(args) -> int:
    from common.traces import load_trace
    from flashmoe.bench import learner_cpu

    trace = load_trace(args.trace, Path(args.traces_dir))
    report = learner_cpu.measure(trace, _config(args), args.warmup, args.pause_ms, args.tokens)
    print(learner_cpu.format_table(report))
    _save(args, report)
    return 0


def cmd_ablations(args) -> int:
    from common.traces import load_trace
    from flashmoe.bench import ablations
    from flashmoe.sim.device_model import DEVICES, MODEL_SHAPES

    fit = load_trace("gptoss20b:fit", Path(args.traces_dir))
    dev = load_trace("gptoss20b:dev", Path(args.traces_dir))
    report = ablations.ablations(fit, dev, DEVICES["orin-980pro"], MODEL_SHAPES[fit.model],
                                 _config(args), args.variants, tuple(args.capacity), args.jobs)
    print(ablations.format_table(report))
    _save(args, report)
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


def cmd_doctor(args) -> int:
    from flashmoe.runtime.doctor import FAIL, doctor, format_checks

    checks = doctor(_config(args), args.store)
    print(format_checks(checks))
    return 1 if any(c.verdict == FAIL for c in checks) else 0


def cmd_deploy(args) -> int:
    from flashmoe import deploy

    common = dict(compose_files=args.compose or ["compose.yaml"], project=args.project,
                  profiles=args.compose_profile, docker_host=args.docker_host)
    try:
        if args.deploy_command == "up":
            rows = deploy.deploy_up(**common, build=args.build, wait=args.wait,
                                    timeout_s=args.timeout)
        elif args.deploy_command == "status":
            rows = deploy.deploy_status(**common)
        else:
            for line in deploy.deploy_down(**common, volumes=args.volumes):
                print(line)
            return 0
    except deploy.DeployError as exc:
        print(f"flashmoe deploy {args.deploy_command}: error: {exc}", file=sys.stderr)
        return 2
    print(deploy.format_status(rows))
    return 0 if all(row.ok for row in rows) or args.deploy_command == "up" else 1


def cmd_run(args) -> int:
    from flashmoe.runtime.run import format_summary, run
    from flashmoe.runtime.supervisor import SupervisionError

    overrides = ["cache.policy=flashmoe", f"cache.capacity_experts={args.capacity}",
                 *_overrides(args)]
    config = load_config(profile=args.profile, file=args.config, overrides=overrides)
    try:
        summary = run(config, Path(args.home), args.store, args.warmup, args.trace,
                      None if args.loop else args.tokens, args.loop, args.token_ms,
                      Path(args.traces_dir))
    except SupervisionError:
        return 1
    print(format_summary(summary))
    if args.json:
        write_json(summary, args.json)
    return 0


def cmd_e2e_bench(args) -> int:
    from flashmoe.bench import e2e as e2e_bench

    workdir = Path(args.workdir)
    warmup = args.warmup
    if warmup is None and "flashmoe" in args.modes:
        from common.traces import load_trace
        from flashmoe.sim.learning import warmup as run_warmup
        from flashmoe.sim.learning import warmup_fits

        warmup = str(workdir / "warmup")
        config = load_config(env={}, overrides=list(args.set))  # as the flashmoe mode runs
        if not warmup_fits(warmup, config):
            print("[e2e] warming the learned policy up on the train split (first use only)")
            run_warmup(load_trace("gptoss20b:train", Path(args.traces_dir)), config, warmup)
    report = e2e_bench.e2e_bench(workdir, args.scale, args.budget, args.tokens, args.rounds,
                                 args.modes, warmup, trace=args.trace, shape=args.shape,
                                 settings=args.set)
    print(e2e_bench.format_table(report))
    _save(args, report, e2e_bench.plot)
    return 0


def cmd_cluster_bench(args) -> int:
    from flashmoe.bench import cluster as cluster_bench

    overrides = ["cache.policy=flashmoe", *_overrides(args)]
    config = load_config(profile=args.profile, file=args.config, overrides=overrides)
    report = cluster_bench.cluster_bench(config, Path(args.workdir), config.cluster.redis_url
                                         or None, args.tokens, args.capacity,
                                         args.warmup_tokens, args.device, Path(args.traces_dir))
    print(cluster_bench.format_table(report))
    _save(args, report, cluster_bench.plot)
    return 0


def cmd_flat_worker(args) -> int:
    from flashmoe.bench.e2e import main_flat_worker

    return main_flat_worker(args)


def cmd_config(args) -> int:
    if args.fields:
        for row in describe_fields():
            bounds = (f"choices {row['choices']}" if row["choices"] else
                      f"[{row['lo']}, {row['hi']}]" if row["lo"] is not None else "")
            print(f"{row['key']:<28} {row['default']!s:<10} {bounds:<24} {row['doc']}")
        return 0
    print(json.dumps(_config(args).to_dict(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("convert", help="HF MoE checkpoint folder -> block-striped expert store")
    p.add_argument("hf_dir")
    p.add_argument("store")
    p.add_argument("--block-size", help="bytes per block, e.g. 256K (default: store.block_size "
                                        "of the profile/config)")
    p.add_argument("--parallelism", type=int, help="stripe files (default: store.parallelism)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_config_flags(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("generate", help="generate text with a store's model, its experts "
                                        "through the cache manager")
    p.add_argument("--store", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--cache", help="a running cache manager's endpoint (default: start one for "
                                   "this run)")
    p.add_argument("--events", help="PUB endpoint to bind for the AccessEvents it publishes")
    p.add_argument("--json", metavar="FILE", help="write token ids, text and the cache stats")
    _add_config_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("synth-store", help="a store of random bf16 experts in a real model's "
                                           "shape (for trace-driven runs)")
    p.add_argument("store")
    p.add_argument("--shape", default="gpt-oss-20b", help="gpt-oss-20b, or gpt-oss-tiny (tests)")
    p.add_argument("--scale", type=float, default=None,
                   help="multiplies each expert's intermediate size (default 0.21: ~8 GB for "
                        "gpt-oss-20b)")
    p.add_argument("--block-size", help="bytes per block (default: store.block_size)")
    p.add_argument("--parallelism", type=int, help="stripe files (default: store.parallelism)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_config_flags(p)
    p.set_defaults(func=cmd_synth_store)

    p = sub.add_parser("verify", help="check every block's checksum; non-zero on the first bad")
    p.add_argument("store")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("io-bench", help="IO engine MB/s and latency against the fio ceiling")
    p.add_argument("store")
    p.add_argument("--engine", type=_csv(str), default=["uring"],
                   help="uring, pread or auto; comma-separated for several")
    p.add_argument("--depth", type=_csv(int), default=[8], help="queue depth(s), e.g. 1,8,32")
    p.add_argument("--repeat", type=int, default=5, help="interleaved passes per figure (median)")
    p.add_argument("--no-fio", action="store_true", help="skip the fio ceiling")
    p.add_argument("--with-manager", action="store_true",
                   help="also a live cache manager loading every expert by PrefetchHints "
                        "(row manager-prefetch), in the same rounds")
    p.add_argument("--json", metavar="FILE")
    p.set_defaults(func=cmd_io_bench)

    p = sub.add_parser("acquire-bench", help="round-trip time of an all-resident AcquireReq")
    p.add_argument("store")
    p.add_argument("--iterations", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved rounds (each figure: the median over rounds)")
    p.add_argument("--engine", default="auto")
    p.add_argument("--json", metavar="FILE")
    p.set_defaults(func=cmd_acquire_bench)

    p = sub.add_parser("serve-cache", help="run the cache manager process")
    p.add_argument("store")
    p.add_argument("--endpoint", required=True, help="ZeroMQ endpoint to bind, e.g. ipc:///x.sock")
    p.add_argument("--control-endpoint", help="control socket (health, stats); default: "
                                              "the endpoint's x.control.sock for ipc")
    p.add_argument("--predictions", type=_csv(str), default=[],
                   help="the predictor's PUB endpoint(s) to subscribe to")
    _add_config_flags(p)
    p.set_defaults(func=cmd_serve_cache)

    p = sub.add_parser("serve-features", help="run the feature extractor process")
    p.add_argument("store")
    p.add_argument("--events", type=_csv(str), required=True,
                   help="the workers' AccessEvent PUB endpoint(s)")
    p.add_argument("--endpoint", required=True, help="PUB endpoint to bind for FeatureBatches")
    p.add_argument("--control-endpoint")
    p.add_argument("--warmup", metavar="CKPT", help="start from a warm-up checkpoint's tables")
    _add_config_flags(p)
    p.set_defaults(func=cmd_serve_features)

    p = sub.add_parser("serve-predictor", help="run the predictor process")
    p.add_argument("store")
    p.add_argument("--features", type=_csv(str), required=True,
                   help="the feature extractor's PUB endpoint(s)")
    p.add_argument("--endpoint", required=True, help="PUB endpoint to bind for Predictions")
    p.add_argument("--control-endpoint")
    p.add_argument("--checkpoint-dir", required=True,
                   help="where the predictor checkpoints itself (and resumes from)")
    p.add_argument("--warmup", metavar="CKPT", help="a warm-up checkpoint for a first start")
    _add_config_flags(p)
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
    _add_config_flags(p)
    p.set_defaults(func=cmd_serve_panel)

    p = sub.add_parser("build-helper", help="compile the C helpers: the io_uring engine's "
                       "and the predictor's fused inference")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_build_helper)

    p = sub.add_parser("make-tiny-model", help="save a random-weight MoE model (no download)")
    p.add_argument("family", choices=("qwen3_moe", "olmoe", "mixtral", "gpt_oss"))
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--expert-intermediate", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("bench", help="replay a routing trace through cache policies")
    p.add_argument("--trace", default="gptoss20b:eval",
                   help="gptoss20b:train|eval|all, warp:olmoe|kimi, or a trace file")
    p.add_argument("--scope", choices=("global", "layer"), default="global")
    p.add_argument("--capacity", type=_csv(float), default=[0.0625, 0.125, 0.25, 0.5],
                   help="fractions of the experts (of one layer in the layer scope)")
    p.add_argument("--policies", type=_csv(str),
                   default=["lru", "arc", "lirs", "car", "s3fifo", "sieve", "belady"])
    p.add_argument("--device", choices=sorted(DEVICE_NAMES), default="orin-980pro")
    p.add_argument("--model", help="model-shape profile for expert bytes (default: the trace's)")
    p.add_argument("--expert-bytes", type=int, help="bytes per expert, for a trace of a model "
                                                     "without a shape profile")
    p.add_argument("--mode", choices=("core", "requests"), default="core",
                   help="core: the cache manager's core on a virtual clock (default); "
                        "requests: the plain per-request replay (libCacheSim's protocol)")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: cores)")
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR))
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--warmup", metavar="CKPT", help="a `flashmoe warmup` checkpoint for the "
                                                   "learned policy (default: cold start)")
    p.add_argument("--prefetch", action="store_true",
                   help="the inline next-layer prefetcher on, for every policy but belady, "
                        "and flashmoe's look-ahead prefetch (while that runs on an estimate the "
                        "inline one stands down unless prefetch.inline_with_learned)")
    p.add_argument("--stale-tokens", type=int, default=0,
                   help="deliver the learned policy's estimates this many tokens late")
    p.add_argument("--quiet", action="store_true", help="no progress bar (none either when "
                                                        "stderr is not a terminal)")
    _add_config_flags(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("warmup", help="pre-train the learned policy (feature tables and the "
                                      "predictor) on a routing trace")
    p.add_argument("--trace", default="gptoss20b:train")
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR))
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--passes", type=int, default=2, help="online passes over the trace")
    p.add_argument("--store", help="with --text: the store whose model reads the text")
    p.add_argument("--text", help="a text file: run the store's model over it, record its "
                                  "routing and train on that (instead of --trace)")
    p.add_argument("--max-tokens", type=int, help="with --text: read at most this many tokens")
    p.add_argument("--quiet", action="store_true")
    _add_config_flags(p)
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser("trace", help="routing traces")
    trace_sub = p.add_subparsers(dest="trace_command", required=True)
    p = trace_sub.add_parser("record", help="record a transformers MoE model's router decisions")
    p.add_argument("--model", required=True, help="local Hugging Face model folder")
    p.add_argument("--prompts", required=True,
                   help="JSONL: {\"text\": ...} (needs a tokenizer) or {\"input_ids\": [...]}")
    p.add_argument("--out", required=True, help="trace file to write (.npz)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.set_defaults(func=cmd_trace_record)

    p = sub.add_parser("trace-worker", help="replay a routing trace through a live cache "
                                            "manager, as a worker")
    p.add_argument("--cache", required=True, help="the cache manager's endpoint")
    p.add_argument("--trace", default="gptoss20b:eval")
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR))
    p.add_argument("--start", type=int, default=0, help="first decode step (row) to replay")
    p.add_argument("--tokens", type=int, help="decode steps to replay (default: all)")
    p.add_argument("--json", metavar="FILE", help="write the cache manager's stats at the end")
    p.add_argument("--events", help="PUB endpoint to bind for the AccessEvents it publishes")
    p.add_argument("--token-ms", type=float, default=0.0,
                   help="make each decode step last at least this long (a model's pace)")
    p.add_argument("--loop", action="store_true", help="replay the slice again and again "
                                                       "until stopped")
    p.add_argument("--compute", action="store_true",
                   help="run each layer's experts on the fetched weights (real matrix work)")
    _add_config_flags(p)
    p.set_defaults(func=cmd_trace_worker)

    p = sub.add_parser("bus-bench", help="events per second through the learning path's bus")
    p.add_argument("--trace", default="gptoss20b:eval")
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR))
    p.add_argument("--store", help="a store of the trace's shape (default: a tiny synthetic one)")
    p.add_argument("--events", type=int, default=20_000, help="events of the raw test")
    p.add_argument("--rates", type=_csv(float), default=[100.0, 200.0],
                   help="tokens/s fed through extractor and predictor")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each rate's run")
    p.add_argument("--json", metavar="FILE")
    _add_config_flags(p)
    p.set_defaults(func=cmd_bus_bench)

    p = sub.add_parser("task-shift", help="hit rate over the eval split's task switches, and "
                                          "what drift handling buys")
    p.add_argument("--trace", default="gptoss20b:eval")
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR))
    p.add_argument("--capacity", type=float, default=0.125, help="fraction of all experts")
    p.add_argument("--warmup", metavar="CKPT")
    p.add_argument("--window", type=int, default=200, help="tokens per plotted point")
    p.add_argument("--after", type=int, default=1000, help="tokens after a switch (drift)")
    p.add_argument("--device", choices=sorted(DEVICE_NAMES), default="orin-980pro")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    _add_config_flags(p)
    p.set_defaults(func=cmd_task_shift)

    p = sub.add_parser("learning-report", help="recall of the predictions against baselines; "
                                               "the inference precisions (fp32, bf16, int8)")
    p.add_argument("--trace", default="gptoss20b:eval")
    p.add_argument("--warmup-trace", default="gptoss20b:train",
                   help="the split the static hot list comes from")
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR))
    p.add_argument("--warmup", metavar="CKPT")
    p.add_argument("--capacity", type=_csv(float), default=[0.125, 0.25])
    p.add_argument("--json", metavar="FILE")
    _add_config_flags(p)
    p.set_defaults(func=cmd_learning_report)

    p = sub.add_parser("learner-cpu", help="the learning path's CPU a token in-process, with "
                                           "pauses between tokens as a live run has")
    p.add_argument("--trace", default="gptoss20b:eval")
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR))
    p.add_argument("--warmup", metavar="CKPT")
    p.add_argument("--pause-ms", type=_csv(float), default=[0.0, 5.0, 60.0],
                   help="pauses between tokens to measure (0: a tight loop)")
    p.add_argument("--tokens", type=int, default=300, help="tokens a row")
    p.add_argument("--json", metavar="FILE")
    _add_config_flags(p)
    p.set_defaults(func=cmd_learner_cpu)

    p = sub.add_parser("ablations", help="each mechanism of the learned policy on or off: "
                                         "warm-up on fit, measured on dev")
    p.add_argument("--variants", type=_csv(str), default=None,
                   help="which ablations (default: all; see flashmoe/ablations.py)")
    p.add_argument("--capacity", type=_csv(float), default=[0.125, 0.25])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR))
    p.add_argument("--json", metavar="FILE")
    _add_config_flags(p)
    p.set_defaults(func=cmd_ablations)

    p = sub.add_parser("doctor", help="check io_uring, O_DIRECT, memlock, /dev/shm, the kernel "
                                      "and the SSD's power state; each with a fix")
    p.add_argument("store", nargs="?", help="the store to check (O_DIRECT, the arena's size)")
    _add_config_flags(p)
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("health", help="a health check: one round trip on a service's control "
                                      "socket (exit 0 when it is running)")
    p.add_argument("endpoint", help="the service's control endpoint")
    p.add_argument("--timeout", type=float, default=3.0)
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("deploy", help="the compose file's services through the Docker SDK")
    deploy_sub = p.add_subparsers(dest="deploy_command", required=True)
    for name, text in (("up", "create and start"), ("status", "state and health of each "
                                                              "service"),
                       ("down", "stop and remove")):
        q = deploy_sub.add_parser(name, help=text)
        q.add_argument("--compose", action="append", metavar="FILE",
                       help="compose file(s) (default compose.yaml; repeat for overrides)")
        q.add_argument("--project", help="project name (default: the folder's)")
        q.add_argument("--docker-host", help="e.g. unix:///var/run/docker.sock")
        q.add_argument("--profile", dest="compose_profile", action="append", default=[],
                       help="compose profile(s) to enable, e.g. cluster")
        if name == "up":
            q.add_argument("--build", action="store_true", help="build the image first")
            q.add_argument("--wait", action="store_true", help="until every service is healthy")
            q.add_argument("--timeout", type=float, default=300.0)
        if name == "down":
            q.add_argument("--volumes", action="store_true", help="remove the volumes too")
        q.set_defaults(func=cmd_deploy)

    p = sub.add_parser("run", help="the whole system as supervised local processes (the main "
                                   "job)")
    p.add_argument("--home", default=".flashmoe/run",
                   help="where the store and warm-up made on first use are kept")
    p.add_argument("--store", help="a store (default: a synthetic gpt-oss-20b one, made once)")
    p.add_argument("--warmup", metavar="CKPT", help="warm-up checkpoint (default: made once)")
    p.add_argument("--trace", default="gptoss20b:eval", help="the routing the worker replays")
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR))
    p.add_argument("--tokens", type=int, default=300, help="decode steps to run")
    p.add_argument("--loop", action="store_true", help="go on until Ctrl-C or SIGTERM")
    p.add_argument("--capacity", type=int, default=192,
                   help="experts the cache holds (default 192: 25%% of gpt-oss-20b's)")
    p.add_argument("--token-ms", type=float, default=0.0,
                   help="a decode step lasts at least this long (a model's pace)")
    p.add_argument("--json", metavar="FILE", help="write the summary")
    _add_config_flags(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("e2e-bench", help="tokens/s end to end on real IO: flashmoe, lru, the "
                                         "mmap page-cache way, all in RAM")
    p.add_argument("--workdir", default=".flashmoe/e2e", help="store, expert file, warm-up")
    p.add_argument("--scale", type=float, default=0.21,
                   help="gpt-oss-20b expert size multiplier (0.21: an ~8 GB store)")
    p.add_argument("--shape", default="gpt-oss-20b",
                   help="gpt-oss-20b; qwen3-moe-1.7b (the mmap calibration against llama.cpp, "
                        "with --trace warp:olmoe --modes mmap,ram); gpt-oss-tiny (tests)")
    p.add_argument("--trace", default="gptoss20b:eval",
                   help="the routing replayed (its first --tokens decode steps)")
    p.add_argument("--budget", type=_csv(float), default=[0.25],
                   help="RAM budget(s) as fractions of all experts' bytes")
    p.add_argument("--tokens", type=int, default=200, help="decode steps of the eval split")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per mode")
    p.add_argument("--modes", type=_csv(str), default=["flashmoe", "lru", "mmap", "ram"])
    p.add_argument("--warmup", metavar="CKPT",
                   help="the learned policy's warm-up (default: made from train, once)")
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR))
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a config override for the flashmoe mode (repeatable)")
    p.set_defaults(func=cmd_e2e_bench)

    p = sub.add_parser("cluster-bench", help="hit rate of a device's first tokens after a warm "
                                             "start from a peer through Redis, against a cold "
                                             "start and a local warm-up")
    p.add_argument("--workdir", default=".flashmoe/cluster-bench", help="the local warm-up")
    p.add_argument("--tokens", type=int, default=1000, help="first tokens of the eval split")
    p.add_argument("--capacity", type=float, default=0.25, help="fraction of all experts")
    p.add_argument("--warmup-tokens", type=int, default=12_000,
                   help="train-split tokens the peer served (and the local warm-up uses)")
    p.add_argument("--device", choices=sorted(DEVICE_NAMES), default="orin-980pro")
    p.add_argument("--traces-dir", default=str(DEFAULT_TRACES_DIR))
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    _add_config_flags(p)  # --redis URL: that Redis, else a private redis-server
    p.set_defaults(func=cmd_cluster_bench)

    p = sub.add_parser("flat-worker", help=argparse.SUPPRESS)
    p.add_argument("--file", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--trace", default="gptoss20b:eval")
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--in-ram", action="store_true")
    p.add_argument("--cgroup", default="", help="join this memory cgroup after start-up")
    p.add_argument("--json", required=True)
    p.set_defaults(func=cmd_flat_worker)

    p = sub.add_parser("config", help="print the effective config (or --fields: every field)")
    p.add_argument("--fields", action="store_true")
    _add_config_flags(p)
    p.set_defaults(func=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"flashmoe {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
