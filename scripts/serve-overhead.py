"""What serving through HTTP costs a decode step: `flashmoe generate` in-process against
`flashmoe serve` driven by `flashmoe serve-bench` at concurrency 1, on the same store, prompt,
cache size and token count.

    python scripts/serve-overhead.py STORE --capacity N [--rounds 3] [--tokens 32] [--seed 0]
        [--json results/serve_overhead.json]

Every contender generates the same tokens: one request of ``--tokens`` tokens from one prompt,
sampled at temperature 1 with ``--seed`` (a random model's greedy output is one special token
over and over, whose empty text a stream does not carry).

Contenders, in a random order in each round (this disk's speed drifts):

  generate     `flashmoe generate`'s engine in-process, with the services the command starts
               (cache manager with the learned policy, extractor, predictor): decode
               ms/token (from its first to its last token, over the tokens after the first);
  serve-lru    `flashmoe serve --set cache.policy=lru`: LRU, the
               learning path running beside it: serve-bench's TPOT of the one streamed request
               (client-side, the same span over the same tokens);
  serve        `flashmoe serve` as it ships (the learned policy).

The servers and generate's services start once, before the first round, and stay up: each
round's request meets a cache (and a learner) that has seen the earlier rounds, in every
contender alike. Overhead: a server's median over
rounds against generate's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from flashmoe.bench.local import free_port  # noqa: E402
from flashmoe.runtime.launch import child_env, cli_command  # noqa: E402

TEMPERATURE = 1.0
PROMPT = "The cache manager evicts the expert needed last and prefetches what is needed soonest."
READY_S = 300.0


class Server:
    def __init__(self, store: str, capacity: int, work: Path, name: str, *settings: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(work / f"{name}.log", "w")
        cmd = cli_command("serve", store, "--home", str(work / f"home-{name}"),
                       "--set", f"serve.port={self.port}", "--set", "panel.port=0",
                       "--set", f"cache.capacity_experts={capacity}",
                       *[x for s in settings for x in ("--set", s)])
        self.proc = subprocess.Popen(cmd, env=child_env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready within {READY_S:g} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class InProcess:
    """`flashmoe generate`'s engine in this process, over the services the command starts
    (cache manager with the learned policy, extractor, predictor), kept up for the whole run
    as a server's are, so that both meet a cache that has seen the earlier rounds."""

    def __init__(self, store: str, capacity: int, work: Path) -> None:
        from common.config import load_config
        from common.store import ExpertStore
        from flashmoe.runtime.launch import Launcher
        from flashmoe.runtime.serve import learned_state_dir, learning_specs

        self.store = store
        self.settings = load_config(env={}, overrides=[
            f"store.path={store}", "cache.policy=flashmoe", f"cache.capacity_experts={capacity}"])
        runtime = Path(tempfile.mkdtemp(prefix="gen-", dir=work))
        state = learned_state_dir(work / "generate-home", ExpertStore.open(store))
        state.mkdir(parents=True, exist_ok=True)
        self.events = f"ipc://{runtime}/worker.events.sock"
        self.launcher = Launcher(self.settings, runtime)
        self.launcher.start_together([(spec.name, spec.command) for spec in learning_specs(
            store, state, self.events, None, self.launcher.endpoint)])

    def run(self, tokens: int, seed: int) -> dict:
        from services.inference_worker.engine import SamplingParams
        from services.inference_worker.generate import generate

        doc = generate(self.store, PROMPT, tokens, self.launcher.endpoint("cache_manager"),
                       self.settings, events=self.events,
                       params=SamplingParams(temperature=TEMPERATURE, seed=seed))
        steps = doc["decode_steps"]
        return {"ms_per_token": round(doc["decode_s"] * 1e3 / steps, 2), "decode_steps": steps,
                "hit_rate": round(doc["stats"]["n_hit"] / max(doc["stats"]["n_hit"]
                                                              + doc["stats"]["n_miss"], 1), 4)}

    def stop(self) -> None:
        self.launcher.stop_all()


def run_bench(server: Server, tokens: int, seed: int, work: Path) -> dict:
    out = work / "bench.json"
    subprocess.run(cli_command("serve-bench", "--url", server.url, "--prompts", "1",
                            "--concurrency", "1", "--max-tokens", str(tokens), "--prompt",
                            PROMPT, "--temperature", str(TEMPERATURE), "--seed", str(seed),
                            "--json", str(out)),
                   env=child_env(), check=True, stdout=subprocess.DEVNULL)
    (row,) = json.loads(out.read_text())["results"]
    return {"ms_per_token": row["tpot_ms_p50"], "itl_ms_p50": row["itl_ms_p50"],
            "ttft_ms_p50": row["ttft_ms_p50"], "hit_rate": row["hit_rate"],
            "stall_free_rate": row["stall_free_rate_level"], "requests": row["requests"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("store")
    p.add_argument("--capacity", type=int, required=True, help="cache.capacity_experts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="tokens a request generates")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--servers", type=lambda text: text.split(","), default=["serve"],
                   help="serve, serve-lru or both (both: two servers up at once, each idle "
                        "one's CPU taken from the other)")
    p.add_argument("--json", default="results/serve_overhead.json")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the servers stop in finally
    work = Path(tempfile.mkdtemp(prefix="serve-overhead-"))
    settings = {"serve": (), "serve-lru": ("cache.policy=lru",)}
    servers = {name: Server(args.store, args.capacity, work, name, *settings[name])
               for name in args.servers}
    runs: dict[str, list[dict]] = {"generate": [], **{name: [] for name in servers}}
    rng = random.Random(args.seed)
    in_process = None
    try:
        in_process = InProcess(args.store, args.capacity, work)
        for server in servers.values():
            server.wait_ready()
        for r in range(args.rounds):
            for name in rng.sample(list(runs), len(runs)):
                run = in_process.run(args.tokens, args.seed) if name == "generate" else \
                    run_bench(servers[name], args.tokens, args.seed, work)
                runs[name].append(run)
                print(f"round {r + 1}/{args.rounds} {name}: {run['ms_per_token']} ms/token",
                      flush=True)
    finally:
        if in_process is not None:
            in_process.stop()
        for server in servers.values():
            server.stop()
    base = statistics.median(x["ms_per_token"] for x in runs["generate"])
    rows = []
    for name, done in runs.items():
        ms = [x["ms_per_token"] for x in done]
        mid = statistics.median(ms)
        rows.append({"contender": name, "ms_per_token": round(mid, 2),
                     "ms_per_token_min": min(ms), "ms_per_token_max": max(ms),
                     "overhead_pct": round((mid / base - 1) * 100, 1),
                     "rounds": done})
    doc = {"store": Path(args.store).name, "capacity_experts": args.capacity,
           "tokens": args.tokens, "rounds": args.rounds, "prompt": PROMPT,
           "temperature": TEMPERATURE, "seed": args.seed, "results": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    for row in rows:
        print(f"{row['contender']:<10} {row['ms_per_token']:>7.1f} ms/token "
              f"({row['ms_per_token_min']}..{row['ms_per_token_max']}) "
              f"{row['overhead_pct']:+.1f}%")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
