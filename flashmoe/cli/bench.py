"""The benchmark commands, one per entry of ``flashmoe.bench.BENCHMARKS``."""

from __future__ import annotations

from flashmoe.bench import BENCHMARKS, Benchmark


def _run(benchmark: Benchmark):
    return lambda args: benchmark.load().run(args)


def register(sub, command: str | None) -> None:
    """One subcommand per benchmark; only ``command``'s module is imported, to add its flags
    (the others are listed with their help line)."""
    for benchmark in BENCHMARKS:
        p = sub.add_parser(benchmark.command, help=benchmark.help, description=benchmark.help)
        if benchmark.command == command:
            benchmark.load().add_arguments(p)
        p.set_defaults(func=_run(benchmark))
