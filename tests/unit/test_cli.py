"""The `flashmoe` command line: every command builds its parser (each registered benchmark
adds its flags), and the shared flags parse the same in every command that takes them."""

import subprocess
import sys

import pytest

from flashmoe import __version__
from flashmoe.bench import BENCHMARKS
from flashmoe.cli.main import build_parser


def commands(parser) -> dict:
    """The subcommand parsers by name."""
    return parser._subparsers._group_actions[0].choices


@pytest.mark.parametrize("benchmark", BENCHMARKS, ids=lambda b: b.command)
def test_every_registered_benchmark_adds_its_flags(benchmark):
    module = benchmark.load()
    assert callable(module.run)
    command = commands(build_parser(benchmark.command))[benchmark.command]
    flags = {option for a in command._actions for option in a.option_strings}
    assert "--json" in flags  # every benchmark can write its report


def test_commands_are_unique():
    names = list(commands(build_parser()))
    assert len(names) == len(set(names))
    assert {"serve-cache", "serve-features", "serve-predictor", "serve-panel", "trace-worker",
            "health", "run", "bench"} <= set(names)


def test_traces_dir_is_unset_unless_given():
    args = build_parser("bench").parse_args(["bench"])
    assert args.traces_dir is None
    args = build_parser("warmup").parse_args(["warmup", "--out", "x", "--traces-dir", "/t"])
    assert args.traces_dir == "/t"


def test_python_dash_m_flashmoe_is_the_command_with_its_version():
    out = subprocess.run([sys.executable, "-m", "flashmoe", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == f"flashmoe {__version__}"
