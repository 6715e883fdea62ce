"""`flashmoe bench`: replay a routing trace through cache policies (``flashmoe.sim.replay``)
and print their hits, bytes and time on a device model, with a plot of hit rate by capacity."""

from __future__ import annotations

import argparse

from flashmoe.cli.options import (add_config_flags, add_device, add_json, add_plot, add_quiet,
                                  add_trace, add_warmup, config, csv, save, trace_of)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_trace(p, help="gptoss20b:train|eval|all, warp:olmoe|kimi, or a trace file")
    p.add_argument("--scope", choices=("global", "layer"), default="global")
    p.add_argument("--capacity", type=csv(float), default=[0.0625, 0.125, 0.25, 0.5],
                   help="fractions of the experts (of one layer in the layer scope)")
    p.add_argument("--policies", type=csv(str),
                   default=["lru", "arc", "lirs", "car", "s3fifo", "sieve", "belady"])
    add_device(p)
    p.add_argument("--model", help="model-shape profile for expert bytes (default: the trace's)")
    p.add_argument("--expert-bytes", type=int, help="bytes per expert, for a trace of a model "
                                                     "without a shape profile")
    p.add_argument("--precision", type=csv(str), default=["native"],
                   help="cache.precision settings: native, int8, int4 (every policy), dynamic "
                        "and random (the policies that take the learned estimate; random "
                        "draws each load's precision with the fractions of dynamic's loads); "
                        "a copy's bytes are a fraction of a bf16 expert's (int8 0.50, int4 "
                        "0.28)")
    p.add_argument("--mode", choices=("core", "requests"), default="core",
                   help="core: the cache manager's core on a virtual clock (default); "
                        "requests: the plain per-request replay (libCacheSim's protocol)")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: cores)")
    add_json(p)
    add_plot(p)
    add_warmup(p, help="a `flashmoe warmup` checkpoint for the learned policy (default: cold "
                       "start)")
    p.add_argument("--prefetch", action="store_true",
                   help="the inline next-layer prefetcher on, for every policy but belady, "
                        "and flashmoe's look-ahead prefetch (while that runs on an estimate the "
                        "inline one stands down unless prefetch.inline_with_learned)")
    p.add_argument("--stale-tokens", type=int, default=0,
                   help="deliver the learned policy's estimates this many tokens late")
    add_quiet(p, help="no progress bar (none either when stderr is not a terminal)")
    add_config_flags(p)


def run(args: argparse.Namespace) -> int:
    from flashmoe.sim.device_model import DEVICES, shape_for_trace
    from flashmoe.sim.replay import run_bench

    from flashmoe.errors import UsageError

    for precision in args.precision:
        if precision not in ("native", "int8", "int4", "dynamic", "random"):
            raise UsageError(f"--precision {precision}: one of native, int8, int4, dynamic, "
                             f"random")
    trace = trace_of(args)
    shape = shape_for_trace(trace, args.model, args.expert_bytes)
    report = run_bench(trace, args.scope, args.capacity, args.policies, DEVICES[args.device],
                       shape, mode=args.mode, jobs=args.jobs,
                       progress=False if args.quiet else None, config=config(args),
                       warmup=args.warmup, prefetch=args.prefetch,
                       stale_tokens=args.stale_tokens, precisions=tuple(args.precision))
    print(format_table(report))
    save(args, report, plot)
    return 0


def _cell(value, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}{fmt}}"


def format_table(report: dict) -> str:
    head = (f"{'policy':<8} {'cap':>5} {'frac':>7} {'hits':>10} {'hit rate':>8} {'SSD GB':>9} "
            f"{'gap':>7} {'ms/tok':>8} {'SSD MB/s':>9} {'cache GB':>8}")
    rows = [head, "-" * len(head)]
    last_fraction = None
    for r in report["results"]:
        if last_fraction is not None and r["capacity_fraction"] != last_fraction:
            rows.append("")
        last_fraction = r["capacity_fraction"]
        name = r["policy"] if r.get("precision", "native") == "native" \
            else f"{r['policy']}-{r['precision']}"
        lead = f"{name:<8} {r['capacity']:>5} {r['capacity_fraction']:>7.4f}"
        if "infeasible" in r:
            rows.append(f"{lead}  n/a: {r['infeasible']}")
            continue
        gb = lambda v: None if v is None else v / 1e9  # noqa: E731
        rows.append(f"{lead} {r['hits']:>10} {r['hit_rate']:>8.4f} "
                    f"{_cell(gb(r['ssd_bytes']), '.1f', 9)} {_cell(r['gap_closed'], '.3f', 7)} "
                    f"{_cell(r['ms_per_token'], '.2f', 8)} {_cell(r['ssd_mb_per_s'], '.1f', 9)} "
                    f"{_cell(gb(r['cache_bytes']), '.2f', 8)}")
    rows.append("")
    rows.append(f"{report['trace']}, scope {report['scope']}, mode {report['mode']}: "
                f"{report['sequences']} sequences, {report['tokens']} tokens, "
                f"{report['accesses']} accesses; wall {report['wall_s']} s on "
                f"{report['jobs']} processes")
    a = report["assumptions"]
    if a is None:
        rows.append("no model-shape profile for this trace's model: hit rates only (give "
                    "--expert-bytes N for the time and byte columns)")
    else:
        how = ("the cache manager's core on a virtual clock (pins, loading states; one SSD "
               "channel shared by every read)" if report["mode"] == "core"
               else "per-request replay of the policy (no pins, no clock)")
        rows.append(f"device model {a['device']['name']} ({a['device']['description']}): SSD "
                    f"{a['device']['ssd_bytes_per_s'] / 1e9:.2f} GB/s + "
                    f"{a['device']['ssd_latency_ms']} ms to the first byte, compute "
                    f"{a['compute_ms_per_layer']:.3f} ms/layer; expert "
                    f"{a['model']['expert_bytes'] / 1e6:.2f} MB ({a['model']['name']}); "
                    f"demand fetching; {how}")
    return "\n".join(rows)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in report["results"]):
        rows = [r for r in report["results"] if r["policy"] == policy and r["hit_rate"] is not None]
        ax.plot([r["capacity_fraction"] for r in rows], [r["hit_rate"] for r in rows],
                marker="o", label=policy, linestyle="--" if policy == "belady" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cache capacity (fraction of experts" +
                  (" per layer)" if report["scope"] == "layer" else ")"))
    ax.set_ylabel("hit rate")
    ax.set_title(f"{report['trace']}, {report['scope']} scope, {report['accesses']:,} accesses")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
