"""`flashmoe chaos`: the fault matrix. Real faults against real processes, under load.

Every row is one fault against one target, run ``--runs`` times, each time on a fresh target
(its own ``--home``, store copy and runtime folder; see ``chaos_run`` for the phases):

  run    `flashmoe run --loop` replaying gpt-oss-20b's sample eval trace through a small
         synthetic store of that shape (``flashmoe synth-store --shape gpt-oss-tiny``), a warm-up
         checkpoint made once here, a cache of 64 of its 768 experts;
  serve  `flashmoe serve` on a tiny converted Qwen3-MoE (``make-tiny-model`` + ``convert``:
         2 MoE layers x 8 experts, a cache of 8), a client sending deterministic completions.

The faults are listed in ``chaos_faults.FAULTS`` (``--faults`` picks some). A row counts:

  recovered    runs where the system went on serving (restarted where needed), every request
               got an answer or a typed error, the fault provably took effect, and the target
               exited 0 on SIGTERM;
  hangs        requests (the verifier's acquires, the client's completions) without an answer
               within their bound, plus a target that neither recovered nor exited within 45 s
               of the fault, or did not exit within 40 s of SIGTERM;
  wrong_bytes  bytes served that differ from the store's true bytes (the verifier, see
               ``chaos_probes``) and bytes of completions that differ from the answer before the
               fault (an answer the server declares computed without a bad expert,
               ``X-FlashMoE-Routed-Around``, is counted in ``degraded`` instead, and fails
               the run under any fault but ``corrupt-block``);
  leaks        processes, socket files, /dev/shm arenas, fds grown, and runtime folders kept
               after a clean exit, summed (``leak_detail`` by kind);
  recover_s    from the fault to the first moment everything answered again (p50, p99 over the
               runs that recovered).

Exit status 0 only when every row has 0 hangs, 0 wrong bytes, 0 leaks and every run
recovered. Everything is made under one temporary folder, removed at the end; only processes the
tool started (and their descendants) are ever signalled.
"""

from __future__ import annotations

import argparse
import collections
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from flashmoe.bench.chaos_faults import FAULT_NAMES, FAULTS
from flashmoe.bench.chaos_run import Assets, ChaosRun, RunResult
from flashmoe.cli.options import add_json, csv, save
from flashmoe.runtime.launch import child_env, cli_command

TARGETS = ("run", "serve")
RUN_TRACE = "gptoss20b-sample:eval"
WARMUP_TRACE = "gptoss20b-sample:train"
WARMUP_TOKENS = 400  # a warm-up checkpoint of the right shape, made in seconds
LEAK_KINDS = ("processes", "sockets", "shm", "fds", "runtime_dirs")
# The longest socket path of a target under the tool's folder, and the most an ipc path holds.
DEEPEST_SOCKET = "00-0/tmp/flashmoe-serve-xxxxxxxx/feature_extractor.control.sock"
IPC_PATH_MAX = 107


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=2, help="runs per row (each on a fresh target)")
    p.add_argument("--faults", type=csv(str), default=list(FAULT_NAMES),
                   help=f"faults to run, comma-separated (default all: {', '.join(FAULT_NAMES)})")
    p.add_argument("--targets", type=csv(str), default=list(TARGETS),
                   help="targets, comma-separated: run, serve (default both)")
    p.add_argument("--seed", type=int, default=0, help="seeds the moments of the faults")
    p.add_argument("--keep", metavar="DIR",
                   help="copy each run's logs (the target's and its services') into DIR")
    add_json(p, help="write the rows")


def make_assets(target: str, folder: Path) -> Assets:
    """The original store (and for run the warm-up checkpoint and the trace) of a target."""
    folder.mkdir(parents=True)
    if target == "run":
        from common.config import load_config
        from common.store import ExpertStore
        from common.traces import find_traces_dir, first_sequences, load_trace
        from flashmoe.sim.learning import warmup

        sh(["synth-store", str(folder / "store"), "--shape", "gpt-oss-tiny", "--quiet"])
        traces = find_traces_dir()
        warmup(first_sequences(load_trace(WARMUP_TRACE, traces), WARMUP_TOKENS),
               load_config(env={}), folder / "warmup")
        trace = load_trace(RUN_TRACE, traces)
        layers = ExpertStore.open(folder / "store").manifest.moe_layers
        head = trace.experts[:500]
        counts = collections.Counter((layers[layer], int(e)) for layer in range(head.shape[1])
                                     for e in head[:, layer].ravel())
        return Assets("run", folder / "store", counts.most_common(1)[0][0], folder / "warmup",
                      RUN_TRACE)
    sh(["make-tiny-model", "qwen3_moe", str(folder / "hf")])
    sh(["convert", str(folder / "hf"), str(folder / "store"), "--quiet"])
    from common.store import ExpertStore

    keys = ExpertStore.open(folder / "store").keys()
    return Assets("serve", folder / "store", keys[len(keys) // 2])


def sh(words: list[str]) -> None:
    done = subprocess.run(cli_command(*words), env=child_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"flashmoe {' '.join(words)} failed:\n{done.stdout}{done.stderr}")


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def row(fault: str, target: str, results: list[RunResult]) -> dict:
    detail = {kind: sum(r.leaks.get(kind, 0) for r in results) for kind in LEAK_KINDS}
    times = [r.recover_s for r in results if r.recovered and r.recover_s is not None]
    examples = [e for r in results for e in r.leak_examples][:4]
    return {"fault": fault, "target": target, "runs": len(results),
            "recovered": sum(r.recovered for r in results),
            "hangs": sum(r.hangs for r in results),
            "wrong_bytes": sum(r.wrong_bytes for r in results),
            "degraded": sum(r.degraded for r in results),
            "leaks": sum(detail.values()),
            "recover_s_p50": percentile(times, 50), "recover_s_p99": percentile(times, 99),
            "leak_detail": {**detail, "examples": examples},
            "wall_s": round(sum(r.wall_s for r in results), 1),
            "notes": [n for r in results for n in r.notes][:6]}


def clean(r: dict) -> bool:
    return not r["hangs"] and not r["wrong_bytes"] and not r["leaks"] and \
        r["recovered"] == r["runs"]


def format_table(rows: list[dict]) -> str:
    head = (f"{'fault':<24}{'target':<7}{'runs':>5}{'recov':>6}{'hangs':>6}{'wrong':>7}"
            f"{'leaks':>6}{'p50 s':>7}{'p99 s':>7}  verdict")
    lines = [head, "-" * len(head)]
    for r in rows:
        p50 = "-" if r["recover_s_p50"] is None else f"{r['recover_s_p50']:.1f}"
        p99 = "-" if r["recover_s_p99"] is None else f"{r['recover_s_p99']:.1f}"
        verdict = "ok" if clean(r) else "FAIL: " + (r["notes"][0][:150] if r["notes"] else
                                                    f"leaks {r['leak_detail']['examples'][:1]}")
        lines.append(f"{r['fault']:<24}{r['target']:<7}{r['runs']:>5}{r['recovered']:>6}"
                     f"{r['hangs']:>6}{r['wrong_bytes']:>7}{r['leaks']:>6}{p50:>7}{p99:>7}  "
                     f"{verdict}")
    return "\n".join(lines)


def keep_logs(run_folder: Path, to: Path) -> None:
    shutil.copytree(run_folder, to, symlinks=True,
                    ignore=shutil.ignore_patterns("store", "*.sock", "*.safetensors", "*.bin"))


def run(args) -> int:
    unknown = sorted(set(args.faults) - set(FAULT_NAMES)) + sorted(set(args.targets) -
                                                                   set(TARGETS))
    if unknown or args.runs < 1:
        print(f"flashmoe chaos: error: {'unknown ' + ', '.join(unknown) if unknown else '--runs'}"
              f" (faults: {', '.join(FAULT_NAMES)}; targets: {', '.join(TARGETS)}; runs >= 1)",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    rng = random.Random(args.seed)
    faults = [f for f in FAULTS if f.name in args.faults]
    root = Path(tempfile.mkdtemp(prefix="flashmoe-chaos-"))
    if len(f"{root}/{DEEPEST_SOCKET}") > IPC_PATH_MAX:
        root.rmdir()
        root = Path(tempfile.mkdtemp(prefix="flashmoe-chaos-", dir="/tmp"))
        print(f"[chaos] the temporary folder is too deep for the targets' ipc sockets; using "
              f"{root}", flush=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    rows = []
    try:
        for target in (t for t in TARGETS if t in args.targets):
            print(f"[chaos] {target}: making its store", flush=True)
            assets = make_assets(target, root / f"assets-{target}")
            for fault in faults:
                results = []
                for i in range(args.runs):
                    folder = root / f"{len(rows):02d}-{i}"  # short: ipc paths have 107 bytes
                    folder.mkdir()
                    result = ChaosRun(assets, fault, folder, rng.randrange(1 << 30),
                                      keep_logs=bool(args.keep)).execute()
                    results.append(result)
                    print(f"[chaos] {fault.name} on {target}, run {i + 1}: "
                          f"{'recovered' if result.recovered else 'NOT recovered'} in "
                          f"{result.recover_s} s, hangs {result.hangs}, wrong bytes "
                          f"{result.wrong_bytes}, leaks {result.leaks or 0}; {result.probes}; "
                          f"{result.wall_s} s"
                          + "".join(f"\n[chaos]   {n}" for n in result.events + result.notes),
                          flush=True)
                    if args.keep:
                        keep_logs(folder, Path(args.keep) / f"{target}-{fault.name}-{i}")
                    shutil.rmtree(folder, ignore_errors=True)
                rows.append(row(fault.name, target, results))
    except KeyboardInterrupt:
        print("[chaos] interrupted; the rows so far follow", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(root, ignore_errors=True)
    wall = time.monotonic() - started
    print(format_table(rows))
    print(f"{len(rows)} rows, {sum(r['runs'] for r in rows)} runs in {wall / 60:.1f} min "
          f"({wall:.0f} s)")
    save(args, {"results": rows, "runs_per_row": args.runs, "wall_s": round(wall, 1),
                "seed": args.seed})
    return 0 if rows and all(clean(r) for r in rows) and \
        len(rows) == len(faults) * len(args.targets) else 1
