"""The `flashmoe` command line.

A command answers a mistake with one line and a non-zero exit, never a traceback: a user's
mistake (a missing store, a bad flag or config value) exits 2, a failure that is not one (a
service that died, a cache manager that does not answer) exits 1, anything else is an internal
error (exit 1, its type and message on one line). ``--debug`` (anywhere on the command line)
shows the traceback; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from common.config import ConfigError
from common.model_families import UnsupportedModelError
from common.safetensors_io import SafetensorsError
from common.store import StoreError
from common.traces import TraceError
from flashmoe import __version__
from flashmoe.cli import bench, deploy, learn, runtime, services, store
from flashmoe.errors import CheckpointError, UsageError
from services.cache_manager.policies import PolicyError

USER_ERRORS = (StoreError, ConfigError, UnsupportedModelError, SafetensorsError, FileNotFoundError,
               NotADirectoryError, IsADirectoryError, PermissionError, TraceError, PolicyError,
               CheckpointError, UsageError)
DEBUG_FLAG = "--debug"
EXIT_USER, EXIT_FAILURE, EXIT_INTERRUPTED = 2, 1, 130


class Parser(argparse.ArgumentParser):
    """An argparse parser whose mistakes are one line (the usage is a ``--help`` away)."""

    def error(self, message: str):
        self.exit(EXIT_USER, f"{self.prog}: error: {message} (`{self.prog} --help` lists the "
                             f"flags)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; of the benchmarks, only ``command``'s flags are added."""
    parser = Parser(prog="flashmoe", description=__doc__)
    parser.add_argument("--version", action="version", version=f"flashmoe {__version__}")
    parser.add_argument(DEBUG_FLAG, action="store_true",
                        help="show the traceback of an error (allowed anywhere on the line)")
    sub = parser.add_subparsers(dest="command", required=True)
    runtime.register(sub)
    store.register(sub)
    services.register(sub)
    learn.register(sub)
    bench.register(sub, command)
    deploy.register(sub)
    return parser


def failures() -> tuple[type[Exception], ...]:
    """Failures that are not the user's mistake but need no traceback either: what they say is
    all there is to know (an OSError names its file and errno). Imported when one is caught, so
    that a command starts faster."""
    from common.bus import ConfigMismatch, ServiceUnavailable
    from common.cache_client import CacheManagerUnavailable, ExpertLoadError
    from common.cbuild import BuildError
    from flashmoe.runtime.launch import ServiceStartError
    from flashmoe.runtime.supervisor import SupervisionError

    return (ConfigMismatch, ServiceUnavailable, CacheManagerUnavailable, ExpertLoadError,
            BuildError, ServiceStartError, SupervisionError, OSError)


def one_line(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = DEBUG_FLAG in argv
    argv = [a for a in argv if a != DEBUG_FLAG]
    command = next((a for a in argv if not a.startswith("-")), None)
    name = f"flashmoe {command}" if command else "flashmoe"
    try:
        args = build_parser(command).parse_args(argv)
        return args.func(args)
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except USER_ERRORS as exc:
        _report(debug, f"{name}: error: {one_line(exc)}")
        return EXIT_USER
    except Exception as exc:
        if isinstance(exc, failures()):
            _report(debug, f"{name}: error: {one_line(exc)}")
        else:
            _report(debug, f"{name}: internal error: {type(exc).__name__}: {one_line(exc)}"
                           + ("" if debug else f" ({DEBUG_FLAG} shows the traceback)"))
        return EXIT_FAILURE


def _report(debug: bool, line: str) -> None:
    if debug:
        traceback.print_exc()
    print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
