"""The benchmark programs, one module each, and their registry.

A benchmark module owns its command: ``add_arguments(parser)`` adds its flags, ``run(args)``
runs it, prints its table and writes its JSON (and plot), returning the exit status; its
``format_table`` (and ``plot``) are beside them. ``BENCHMARKS`` is the one list the CLI builds
its benchmark commands from; a module is imported only when its command runs (several load
torch), so ``flashmoe --help`` and the services' start stay light.

Beside them: ``prefetch_stream`` (io-bench's live cache manager row) and ``flat_worker`` (the
worker of e2e-bench's mmap and ram modes, ``python -m flashmoe.bench.flat_worker``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Benchmark:
    command: str  # the `flashmoe` subcommand
    module: str  # flashmoe.bench.<module>
    help: str

    def load(self) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.module}")


BENCHMARKS = (
    Benchmark("bench", "replay", "replay a routing trace through cache policies"),
    Benchmark("io-bench", "io", "IO engine MB/s and latency against the fio ceiling"),
    Benchmark("acquire-bench", "acquire", "round-trip time of an all-resident AcquireReq"),
    Benchmark("bus-bench", "bus", "events per second through the learning path's bus"),
    Benchmark("task-shift", "task_shift", "hit rate over the eval split's task switches, and "
                                          "what drift handling buys"),
    Benchmark("precision-report", "precision_report", "what INT8 and INT4 expert copies do "
              "to the experts' outputs and the next-token distributions"),
    Benchmark("learning-report", "learning_report", "recall of the predictions against "
              "baselines; the inference precisions (fp32, bf16, int8)"),
    Benchmark("learner-cpu", "learner_cpu", "the learning path's CPU a token in-process, with "
                                            "pauses between tokens as a live run has"),
    Benchmark("ablations", "ablations", "each mechanism of the learned policy on or off: "
                                        "warm-up on fit, measured on dev"),
    Benchmark("e2e-bench", "e2e", "tokens/s end to end on real IO: flashmoe, lru, the mmap "
                                  "page-cache way, all in RAM"),
    Benchmark("cluster-bench", "cluster", "hit rate of a device's first tokens after a warm "
                                          "start from a peer through Redis, against a cold "
                                          "start and a local warm-up"),
    Benchmark("serve-bench", "serve", "TTFT, inter-token latency and tokens/s of a running "
                                      "`flashmoe serve`, through the OpenAI client"),
    Benchmark("chaos", "chaos", "the fault matrix: kills, a corrupt block, EIO, slow reads, a "
                                "full disk, a removed arena, a Redis restart, a frozen worker, "
                                "against `run` and `serve` under load"),
    Benchmark("soak", "soak", "a long run of `run --loop` or `serve` under serve-bench: memory, "
                              "fds, threads, shm and table sizes each minute, growth per hour"),
)
