"""Draws docs/img/e2e_bars.png from results/e2e_bench*.json: tokens/s by mode and RAM budget,
the bar at the median of the rounds, the whisker from the slowest to the fastest round.
Run from the repository root: python docs/img/e2e_bars.py"""
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

runs = [json.loads(Path(f"results/{name}.json").read_text())
        for name in ("e2e_bench", "e2e_bench_125")]
modes = ["ram", "lru", "flashmoe", "mmap"]
fig, ax = plt.subplots(figsize=(8, 4.2))
width = 0.2
for i, mode in enumerate(modes):
    rows = [next(r for r in run["results"] if r["mode"] == mode) for run in runs]
    med = [r["tokens_per_s"] for r in rows]
    err = [[m - r["tokens_per_s_min"] for m, r in zip(med, rows)],
           [r["tokens_per_s_max"] - m for m, r in zip(med, rows)]]
    ax.bar([j + (i - 1.5) * width for j in range(len(runs))], med, width, yerr=err, capsize=4,
           label=mode)
ax.set_xticks(range(len(runs)),
              [f"RAM budget {run['results'][0]['budget_fraction']:.1%} of the experts\n"
               f"{run['tokens']} tokens x {run['rounds']} rounds" for run in runs])
ax.set_ylabel("tokens/s (median, min..max of rounds)")
ax.set_title("end to end on real IO, gpt-oss-20b shape at scale 0.21")
ax.legend()
ax.grid(axis="y", alpha=0.3)
fig.tight_layout()
fig.savefig("docs/img/e2e_bars.png", dpi=110)
