"""`flashmoe soak`: a long run of `flashmoe run --loop` or of `flashmoe serve` under
`flashmoe serve-bench`, its resources sampled every ``--interval-s``, growth per hour reported.

Every sample reads, for each service of the target's process tree (``chaos_procs``: found by
their command lines, followed across restarts), its resident memory, open fds and threads from
/proc; the target's arenas' bytes in /dev/shm; and, from the panel's ``/api/stats``, the sizes
of the tables that grow with what is served (``TABLE_STATS``). A series' growth is the slope of
a least-squares line through its samples after ``--settle-min`` (start-up and the first
allocations), per hour; flat is the target. The report keeps every sample.

  run    `flashmoe run --loop` on ``--home`` (the main job's, by default: its store and warm-up
         are made once), the trace worker replaying in a loop at ``--token-ms``;
  serve  `flashmoe serve STORE` (``--store``, default a tiny converted Qwen3-MoE made in a
         temporary folder) driven by `flashmoe serve-bench` with ``--concurrency`` requests in
         flight, run again and again (``ServeBenchLoop``) for as long as the soak lasts.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from flashmoe.bench.chaos_procs import SHM_DIR, ProcessTree
from flashmoe.bench.local import free_port
from flashmoe.cli.options import add_json
from flashmoe.reports import write_json
from flashmoe.runtime.launch import child_env, cli_command, stop_process

# Stats whose values are sizes of tables that grow with the tokens or workers seen.
TABLE_STATS = {"feature_extractor": ("token_rows",),
               "cache_manager": ("prefetcher_token_rows", "prefetcher_streams", "workers")}
READY_TIMEOUT_S = 1200.0  # the main job's first start makes its store and warm-up
STOP_GRACE_S = 60.0
BENCH_PROMPTS = 32  # completions a serve-bench batch (serve: the load)


def proc_status(pid: int) -> dict[str, int] | None:
    """Resident memory (bytes), threads and open fds of a live process."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {"rss_bytes": int(fields["VmRSS"].split()[0]) * 1024,
            "threads": int(fields["Threads"]), "fds": fds}


def shm_bytes(pids: set[int]) -> int:
    """Bytes of the /dev/shm files named after one of ``pids`` (the arenas)."""
    total = 0
    for path in SHM_DIR.glob("flashmoe*"):
        if any(f"-{pid}-" in path.name for pid in pids):
            try:
                total += path.stat().st_size
            except OSError:
                pass
    return total


def get_json(url: str, token: str | None = None) -> dict | None:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"}
                                     if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())
    except (OSError, ValueError):
        return None


class Target:
    """The command under soak, in its own session, and what drives it."""

    def __init__(self, args: argparse.Namespace, scratch: Path) -> None:
        self.panel_port, self.token = free_port(), secrets.token_hex(8)
        self.load: subprocess.Popen | None = None
        settings = ["--set", f"panel.port={self.panel_port}", "--set", f"panel.token={self.token}"]
        if args.target == "run":
            words = ["run", "--loop", "--home", args.home or ".flashmoe/run", "--token-ms",
                     str(args.token_ms), *(["--store", args.store] if args.store else [])]
        else:
            store = args.store or str(self.tiny_store(scratch))
            self.api_port = free_port()
            words = ["serve", store, "--home", args.home or str(scratch / "home"),
                     "--set", f"serve.port={self.api_port}"]
        self.log = open(scratch / f"{args.target}.log", "ab")
        self.proc = subprocess.Popen(cli_command(*words, *settings), env=child_env(),
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.tree = ProcessTree(self.proc.pid)
        self.args, self.scratch = args, scratch

    @staticmethod
    def tiny_store(scratch: Path) -> Path:
        for words in (["make-tiny-model", "qwen3_moe", str(scratch / "hf")],
                      ["convert", str(scratch / "hf"), str(scratch / "store")]):
            subprocess.run(cli_command(*words), env=child_env(), check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return scratch / "store"

    def stats(self) -> dict | None:
        return get_json(f"http://127.0.0.1:{self.panel_port}/api/stats", self.token)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args.target} exited with {self.proc.returncode}; "
                                   f"its output: {self.log.name}")
            ready = self.stats() is not None
            if ready and self.args.target == "serve":
                health = get_json(f"http://127.0.0.1:{self.api_port}/health")
                ready = bool(health) and health.get("status") == "ok"
            if ready:
                break
            time.sleep(2)
        else:
            raise RuntimeError(f"{self.args.target} not ready in {READY_TIMEOUT_S:g} s")
        if self.args.target == "serve":
            self.load = ServeBenchLoop(f"http://127.0.0.1:{self.api_port}",
                                       self.args.concurrency, self.log)

    def sample(self, t_min: float) -> dict:
        alive = [s for s in self.tree.alive(include_root=False) if s.role]
        services = {}
        for seen in alive:
            status = proc_status(seen.pid)
            if status is not None:
                services.setdefault(seen.role, status)
        stats = (self.stats() or {}).get("services", {})
        tables = {f"{role}.{key}": stats[role][key]
                  for role, keys in TABLE_STATS.items() for key in keys
                  if isinstance(stats.get(role), dict) and key in stats[role]}
        return {"minute": round(t_min, 2), "services": services, "tables": tables,
                "shm_bytes": shm_bytes({s.pid for s in alive}),
                "restarts": len([s for s in self.tree.seen.values() if s.role]) - len(alive)}

    def stop(self) -> None:
        if self.load is not None:
            self.load.stop()
        stop_process(self.proc, STOP_GRACE_S, kill_group=True)
        self.tree.close()
        self.log.close()


class ServeBenchLoop:
    """`flashmoe serve-bench` run again and again against ``url`` on a thread, a batch of
    ``BENCH_PROMPTS`` completions each time, each batch's prompts drawn with a seed of its
    own (serve-bench holds a batch's requests in memory at once, so the soak's hours of load
    are many batches, not one). Counts the batches and those that failed."""

    def __init__(self, url: str, concurrency: int, log) -> None:
        self.url, self.concurrency, self.log = url, concurrency, log
        self.batches = self.failed = 0
        self.proc: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="soak-serve-bench", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stopping.is_set():
            self.proc = subprocess.Popen(
                cli_command("serve-bench", "--url", self.url, "--prompts", str(BENCH_PROMPTS),
                            "--concurrency", str(self.concurrency), "--max-tokens", "32",
                            "--rounds", "1", "--warmup-prompts", "0",
                            "--seed", str(self.batches)),
                env=child_env(), stdout=subprocess.DEVNULL, stderr=self.log,
                start_new_session=True)
            code = self.proc.wait()
            if self.stopping.is_set():
                break
            self.batches += 1
            self.failed += code != 0

    def stop(self) -> None:
        self.stopping.set()
        if self.proc is not None:
            stop_process(self.proc, STOP_GRACE_S, kill_group=True)
        self.thread.join(STOP_GRACE_S)


def per_hour(samples: list[dict], value, settle_min: float) -> float | None:
    """The least-squares slope of ``value(sample)`` per hour, after ``settle_min``."""
    points = [(s["minute"], value(s)) for s in samples if s["minute"] >= settle_min]
    points = [(m, v) for m, v in points if v is not None]
    if len(points) < 3:
        return None
    minutes, values = np.array(points, dtype=np.float64).T
    return float(np.polyfit(minutes, values, 1)[0] * 60)


def growth(samples: list[dict], settle_min: float) -> list[dict]:
    rows = []
    roles = sorted({role for s in samples for role in s["services"]})
    for role in roles:
        row = {"what": role}
        for key in ("rss_bytes", "fds", "threads"):
            row[f"{key}_per_hour"] = per_hour(
                samples, lambda s: s["services"].get(role, {}).get(key), settle_min)
            row[f"{key}_last"] = next((s["services"][role][key] for s in reversed(samples)
                                       if role in s["services"]), None)
        rows.append(row)
    rows.append({"what": "shm", "bytes_per_hour": per_hour(samples, lambda s: s["shm_bytes"],
                                                           settle_min),
                 "bytes_last": samples[-1]["shm_bytes"] if samples else None})
    for key in sorted({k for s in samples for k in s["tables"]}):
        rows.append({"what": key, "per_hour": per_hour(samples, lambda s: s["tables"].get(key),
                                                       settle_min),
                     "last": samples[-1]["tables"].get(key) if samples else None})
    return rows


def _f(value, scale: float = 1.0, spec: str = ".1f") -> str:
    return "-" if value is None else format(value / scale + 0.0, spec)  # no "-0.0"


def format_table(report: dict) -> str:
    lines = [f"soak of `{report['target']}` for {report['minutes']:g} min, sampled every "
             f"{report['interval_s']:g} s; growth per hour after minute {report['settle_min']:g} "
             f"(restarts seen: {report['restarts']})",
             f"{'what':<40} {'RSS MiB/h':>10} {'RSS MiB':>8} {'fds/h':>7} {'fds':>5} "
             f"{'threads/h':>9} {'threads':>7}"]
    for row in report["growth"]:
        if "rss_bytes_per_hour" in row:
            lines.append(f"{row['what']:<40} {_f(row['rss_bytes_per_hour'], 2**20):>10} "
                         f"{_f(row['rss_bytes_last'], 2**20):>8} {_f(row['fds_per_hour']):>7} "
                         f"{_f(row['fds_last'], spec='.0f'):>5} {_f(row['threads_per_hour']):>9} "
                         f"{_f(row['threads_last'], spec='.0f'):>7}")
        elif "bytes_per_hour" in row:
            lines.append(f"{'/dev/shm (MiB/h, MiB)':<40} {_f(row['bytes_per_hour'], 2**20):>10} "
                         f"{_f(row['bytes_last'], 2**20):>8}")
        else:
            lines.append(f"{row['what'] + ' (rows/h, rows)':<40} {_f(row['per_hour']):>10} "
                         f"{_f(row['last'], spec='.0f'):>8}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", choices=("run", "serve"), default="run")
    p.add_argument("--minutes", type=float, default=30.0, help="how long the soak lasts")
    p.add_argument("--interval-s", type=float, default=60.0, help="seconds between samples")
    p.add_argument("--settle-min", type=float, default=3.0,
                   help="minutes left out of the growth (start-up)")
    p.add_argument("--home", help="the target's --home (run: the main job's .flashmoe/run; "
                                  "serve: a temporary folder)")
    p.add_argument("--store", help="the store (run: its default; serve: a tiny model)")
    p.add_argument("--token-ms", type=float, default=0.0, help="run: the trace worker's pace")
    p.add_argument("--concurrency", type=int, default=2, help="serve: requests in flight")
    add_json(p)


def run(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or args.interval_s <= 0 or args.concurrency < 1:
        print("soak: --minutes and --interval-s must be above 0, --concurrency at least 1")
        return 2
    # SIGTERM ends the soak as Ctrl-C does: the target and its load are stopped (finally)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    scratch = Path(tempfile.mkdtemp(prefix="flashmoe-soak-"))
    target = Target(args, scratch)
    samples: list[dict] = []
    try:
        target.wait_ready()
        started = time.monotonic()
        while True:
            now = (time.monotonic() - started) / 60
            samples.append(target.sample(now))
            print(f"[soak] minute {now:.1f}: "
                  + ", ".join(f"{role} {s['rss_bytes'] / 2**20:.0f} MiB {s['fds']} fds"
                              for role, s in sorted(samples[-1]["services"].items())),
                  flush=True)
            if now >= args.minutes:
                break
            time.sleep(min(args.interval_s, max(0.0, (args.minutes - now) * 60)))
    finally:
        target.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"target": args.target, "minutes": args.minutes, "interval_s": args.interval_s,
              "settle_min": args.settle_min, "restarts": samples[-1]["restarts"],
              "growth": growth(samples, args.settle_min), "samples": samples}
    if target.load is not None:
        report["load"] = {"serve_bench_batches": target.load.batches,
                          "serve_bench_failed": target.load.failed,
                          "prompts_a_batch": BENCH_PROMPTS, "concurrency": args.concurrency}
    print(format_table(report))
    if "load" in report:
        load = report["load"]
        print(f"load: {load['serve_bench_batches']} serve-bench batches of "
              f"{BENCH_PROMPTS} completions ({load['serve_bench_failed']} failed)")
    if args.json:
        write_json(report, args.json)
    return 0
