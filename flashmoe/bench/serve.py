"""`flashmoe serve-bench`: a running `flashmoe serve` driven through the OpenAI client.

In the manner of vLLM's serving benchmark: ``--prompts`` completions, each asked for exactly
``--max-tokens`` tokens (``ignore_eos``), streamed, at most ``--concurrency`` in flight at a
time (asyncio tasks of one ``AsyncOpenAI`` client, no retries). Times are the client's own:

  TTFT  from sending a request to its first streamed text;
  ITL   between two streamed texts of a request (the server sends no chunk for a token whose
        text is empty, e.g. half a UTF-8 character or a special token: that gap then spans
        two tokens, and a request whose every token is special, as a random model's greedy
        output can be, gives no ITL and its end as its first token);
  TPOT  a request's decode time per token, from its first text to its end, over its tokens
        after the first (the usage the server reports counts them);

and, per concurrency level, the output tokens over the wall time of the level
(``tokens_per_s``) and the requests over it (``requests_per_s``). After each level the
server's ``/stats`` give the cache's figures (cumulative since the server started: hit rate,
stall-free rate, router look-ahead recall, estimate, predictor recall, largest batch); the
level's own stall-free rate comes from the difference of its hit and miss counters.

Prompts are texts of a fixed list, drawn with ``--seed`` (or one ``--prompt`` for all).
Several levels (``--concurrency 1,2,4``) run in ``--rounds`` rounds, the levels in a random
order per round (this disk's speed drifts); a level's latencies are pooled over its rounds
and its throughput is the median of its rounds (min..max beside it). ``--warmup-prompts``
requests go first, one at a time, and are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from flashmoe.cli.options import add_json, add_plot, csv, save
from flashmoe.reports import pyplot

TEXTS = (
    "FlashMoE runs Mixture-of-Experts language models whose expert weights do not fit in RAM.",
    "A MoE model uses only a few of its experts per token and layer.",
    "Most of the weights can stay on SSD, if the right ones are in RAM when they are needed.",
    "The cache manager evicts the expert needed last and prefetches what is needed soonest.",
    "The inference worker asks the cache manager for a layer's experts.",
    "Resident experts are answered at once with their arena slots.",
    "Misses are read by the io_uring engine into free slots, every block checksum-verified.",
    "The worker publishes each token's routing on a bus.",
    "The feature extractor turns routing into locality and context features.",
    "The predictor estimates each expert's next use, online.",
    "The hot path never waits for the learning path.",
    "Without a fresh estimate the cache falls back to LRU.",
    "Edge boxes with eight to thirty-two gigabytes of memory run large models slowly.",
    "The disk's speed drifts from minute to minute, so contenders run in rounds.",
    "Once upon a time, a small language model read its experts from a disk.",
    "Write a short story about a cache that learns which books a library needs next.",
)


def prompts_of(n: int, seed: int, text: str | None = None) -> list[str]:
    rng = random.Random(seed)
    return [text or rng.choice(TEXTS) for _ in range(n)]


@dataclass
class Timing:
    """One request as the client saw it."""
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tpot_s: float | None = None
    tokens: int = 0
    latency_s: float = 0.0


async def one_request(client, model: str, prompt: str, max_tokens: int, temperature: float,
                      seed: int | None = None) -> Timing:
    timing = Timing()
    started = time.perf_counter()
    first = last_text = end = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
            seed=seed, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                timing.tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.text:
                    if first is None:
                        first = now
                    else:
                        timing.itl_s.append(now - last_text)
                    last_text = now
                if choice.finish_reason is not None:
                    end = now
        timing.ok = end is not None
        if not timing.ok:
            timing.error = "the stream ended without a finish reason"
    except Exception as exc:  # noqa: BLE001 - a failed request is a figure
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.latency_s = time.perf_counter() - started
    if first is None:  # every token's text was empty: only the end can be timed
        first = end
    if timing.ok:
        timing.ttft_s = first - started
        if timing.tokens > 1 and end > first:
            timing.tpot_s = (end - first) / (timing.tokens - 1)
    return timing


async def run_level(client, model: str, prompts: list[str], concurrency: int,
                    max_tokens: int, temperature: float, seed: int = 0
                    ) -> tuple[list[Timing], float]:
    """Every prompt, at most ``concurrency`` in flight; the timings and the wall time. With
    a temperature above 0 the i-th prompt is sampled with the seed ``seed + i``."""
    gate = asyncio.Semaphore(concurrency)

    async def limited(i: int, prompt: str) -> Timing:
        async with gate:
            return await one_request(client, model, prompt, max_tokens, temperature,
                                     seed + i if temperature > 0 else None)

    started = time.perf_counter()
    timings = await asyncio.gather(*(limited(i, p) for i, p in enumerate(prompts)))
    return list(timings), time.perf_counter() - started


def _ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 2) if values else None


def _level_stats(before: dict, after: dict) -> dict:
    """The cache's figures after a level (cumulative, as /stats gives them) and the level's
    own stall-free rate and generated tokens (differences of the counters)."""
    keys = ("hit_rate", "stall_free_rate", "router_lookahead_recall", "estimate",
            "estimates_used", "predictor_recall", "max_batch", "evictions", "prefetch_learned",
            "requests_cancelled", "requests_failed", "policy", "cache_capacity")
    out = {k: after.get(k) for k in keys}
    hits = after.get("cache_hits", 0) - before.get("cache_hits", 0)
    misses = after.get("cache_misses", 0) - before.get("cache_misses", 0)
    out["stall_free_rate_level"] = round(hits / (hits + misses), 4) if hits + misses else None
    out["server_tokens_generated"] = after.get("tokens_generated", 0) - \
        before.get("tokens_generated", 0)
    return out


def summarize(concurrency: int, rounds: list[tuple[list[Timing], float, dict]]) -> dict:
    """One concurrency level's row: latencies pooled over its rounds, throughput the median
    of its rounds; the server's figures after its last round."""
    done = [t for timings, _, _ in rounds for t in timings if t.ok]
    failed = [t for timings, _, _ in rounds for t in timings if not t.ok]
    ttft = [t.ttft_s for t in done]
    itl = [x for t in done for x in t.itl_s]
    tpot = [t.tpot_s for t in done if t.tpot_s is not None]
    tok_s = [sum(t.tokens for t in timings if t.ok) / wall for timings, wall, _ in rounds]
    req_s = [sum(t.ok for t in timings) / wall for timings, wall, _ in rounds]
    row = {"concurrency": concurrency, "rounds": len(rounds),
           "requests_without_text": sum(not t.itl_s and t.tokens > 1 for t in done),
           "requests": len(done), "failed": len(failed),
           "errors": sorted({t.error for t in failed})[:3],
           "output_tokens": sum(t.tokens for t in done),
           "wall_s": round(sum(wall for _, wall, _ in rounds), 2),
           "tokens_per_s": round(statistics.median(tok_s), 3),
           "tokens_per_s_min": round(min(tok_s), 3), "tokens_per_s_max": round(max(tok_s), 3),
           "requests_per_s": round(statistics.median(req_s), 4),
           "ttft_ms_p50": _ms(ttft, 50), "ttft_ms_p99": _ms(ttft, 99),
           "itl_ms_p50": _ms(itl, 50), "itl_ms_p99": _ms(itl, 99),
           "tpot_ms_p50": _ms(tpot, 50), "tpot_ms_p99": _ms(tpot, 99),
           "latency_ms_p50": _ms([t.latency_s for t in done], 50)}
    row.update(rounds[-1][2])
    row["server_tokens_generated"] = sum(r[2]["server_tokens_generated"] for r in rounds)
    return row


async def serve_bench_async(url: str, prompts: int, concurrency: list[int], max_tokens: int,
                            rounds: int = 1, seed: int = 0, temperature: float = 0.0,
                            api_key: str | None = None, warmup_prompts: int = 1,
                            prompt: str | None = None, say=print) -> dict:
    from openai import AsyncOpenAI

    from flashmoe.runtime.serve import fetch_stats

    url = url.rstrip("/")
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0,
                         timeout=3600.0)
    try:
        model = (await client.models.list()).data[0].id
        texts = prompts_of(prompts, seed, prompt)
        if warmup_prompts:
            await run_level(client, model, prompts_of(warmup_prompts, seed + 1, prompt), 1,
                            max_tokens, temperature, seed + prompts)
        rng = random.Random(seed)
        runs: dict[int, list] = {c: [] for c in concurrency}
        started = time.perf_counter()
        for r in range(rounds):
            for c in rng.sample(concurrency, len(concurrency)):
                before = fetch_stats(url) or {}
                timings, wall = await run_level(client, model, texts, c, max_tokens,
                                                temperature, seed)
                after = fetch_stats(url) or {}
                runs[c].append((timings, wall, _level_stats(before, after)))
                made = sum(t.tokens for t in timings if t.ok)
                say(f"[serve-bench] round {r + 1}/{rounds} concurrency {c}: "
                    f"{made / wall:.2f} tokens/s, {sum(not t.ok for t in timings)} failed")
    finally:
        await client.close()
    return {"url": url, "model": model, "prompts": prompts, "concurrency": concurrency,
            "max_tokens": max_tokens, "rounds": rounds, "seed": seed,
            "temperature": temperature, "api_key_given": bool(api_key),
            "warmup_prompts": warmup_prompts, "prompt": prompt,
            "results": [summarize(c, runs[c]) for c in concurrency],
            "wall_s": round(time.perf_counter() - started, 1)}


def serve_bench(*args, **kwargs) -> dict:
    return asyncio.run(serve_bench_async(*args, **kwargs))


def _f(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict) -> str:
    head = (f"{'conc':>4} {'req':>4} {'fail':>4} {'tok/s':>7} {'(min..max)':>14} {'req/s':>6} "
            f"{'TTFT p50':>8} {'p99':>7} {'ITL p50':>7} {'p99':>7} {'TPOT p50':>8} "
            f"{'hit':>6} {'stall-free':>10} {'look-ahead':>10}")
    rows = [head, "-" * len(head)]
    for r in report["results"]:
        rows.append(f"{r['concurrency']:>4} {r['requests']:>4} {r['failed']:>4} "
                    f"{r['tokens_per_s']:>7.2f} ({r['tokens_per_s_min']:>5.2f}.."
                    f"{r['tokens_per_s_max']:<5.2f}) {r['requests_per_s']:>6.3f} "
                    f"{_f(r['ttft_ms_p50']):>8} {_f(r['ttft_ms_p99']):>7} "
                    f"{_f(r['itl_ms_p50']):>7} {_f(r['itl_ms_p99']):>7} "
                    f"{_f(r['tpot_ms_p50']):>8} {_f(r['hit_rate'], '.3f'):>6} "
                    f"{_f(r['stall_free_rate'], '.3f'):>10} "
                    f"{_f(r['router_lookahead_recall'], '.3f'):>10}")
        for error in r["errors"]:
            rows.append(f"     failed: {error}")
    rows.append(f"model {report['model']} at {report['url']}: {report['prompts']} prompts a "
                f"level, {report['max_tokens']} tokens each, {report['rounds']} round(s); "
                f"times in ms; hit, stall-free, look-ahead: the server's /stats after the "
                f"level (since it started); wall {report['wall_s']} s")
    return "\n".join(rows)


def plot(report: dict, path: str) -> None:
    plt = pyplot()
    rows = report["results"]
    xs = list(range(len(rows)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    ys = [r["tokens_per_s"] for r in rows]
    spread = [[y - r["tokens_per_s_min"] for y, r in zip(ys, rows)],
              [r["tokens_per_s_max"] - y for y, r in zip(ys, rows)]]
    left.bar(xs, ys, 0.6, yerr=spread, capsize=4)
    left.set_ylabel("output tokens/s (whiskers: min..max)")
    for ax in (left, right):
        ax.set_xticks(xs)
        ax.set_xticklabels([str(r["concurrency"]) for r in rows])
        ax.set_xlabel("concurrency")
        ax.grid(True, axis="y", alpha=0.3)
    right.plot(xs, [r["itl_ms_p50"] for r in rows], "o-", label="ITL p50")
    right.plot(xs, [r["itl_ms_p99"] for r in rows], "s--", label="ITL p99")
    right.plot(xs, [r["ttft_ms_p50"] for r in rows], "^:", label="TTFT p50")
    right.set_ylabel("ms")
    right.set_ylim(bottom=0)
    right.legend()
    fig.suptitle(f"flashmoe serve, {report['model']}: {report['prompts']} prompts x "
                 f"{report['max_tokens']} tokens a level, {report['rounds']} round(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the server's base URL (without /v1)")
    p.add_argument("--prompts", type=int, default=16, help="requests a level (and round)")
    p.add_argument("--concurrency", type=csv(int), default=[1],
                   help="requests in flight at most; several levels comma-separated")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens each request generates (ignore_eos: exactly these)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds, the levels in a random order in each")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; above it each request is sampled with its own seed "
                        "(--seed + its index), so a run can be repeated")
    p.add_argument("--seed", type=int, default=0, help="draws the prompts and the order")
    p.add_argument("--prompt", default=None,
                   help="this text for every request, in place of the built-in list")
    p.add_argument("--warmup-prompts", type=int, default=1,
                   help="requests sent first, one at a time, not counted")
    p.add_argument("--api-key", default=None, help="the server's serve.api_key, if it has one")
    add_json(p)
    add_plot(p)


def run(args: argparse.Namespace) -> int:
    if args.prompts < 1 or args.max_tokens < 1 or args.rounds < 1 or \
            not args.concurrency or min(args.concurrency) < 1:
        print("serve-bench: --prompts, --max-tokens, --rounds and --concurrency must be at "
              "least 1")
        return 2
    report = serve_bench(args.url, args.prompts, args.concurrency, args.max_tokens,
                         rounds=args.rounds, seed=args.seed, temperature=args.temperature,
                         api_key=args.api_key, warmup_prompts=args.warmup_prompts,
                         prompt=args.prompt)
    print(format_table(report))
    save(args, report, plot)
    return 0 if all(r["failed"] == 0 for r in report["results"]) else 1
