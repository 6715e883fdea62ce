"""The `flashmoe` command line: one module per group of commands, the flags they share in
``options``, the parser and the entry point in ``main``."""

from flashmoe.cli.main import main

__all__ = ["main"]
