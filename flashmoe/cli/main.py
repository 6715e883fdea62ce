"""The `flashmoe` command line."""

from __future__ import annotations

import argparse
import sys

from common.config import ConfigError
from common.model_families import UnsupportedModelError
from common.safetensors_io import SafetensorsError
from common.store import StoreError
from common.traces import TraceError
from flashmoe import __version__
from flashmoe.cli import bench, deploy, learn, runtime, services, store
from flashmoe.errors import CheckpointError
from services.cache_manager.policies import PolicyError

USER_ERRORS = (StoreError, ConfigError, UnsupportedModelError, SafetensorsError, FileNotFoundError,
               TraceError, PolicyError, CheckpointError)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; of the benchmarks, only ``command``'s flags are added."""
    parser = argparse.ArgumentParser(prog="flashmoe", description=__doc__)
    parser.add_argument("--version", action="version", version=f"flashmoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    runtime.register(sub)
    store.register(sub)
    services.register(sub)
    learn.register(sub)
    bench.register(sub, command)
    deploy.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"flashmoe {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
