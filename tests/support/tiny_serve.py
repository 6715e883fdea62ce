"""A live `flashmoe serve` of a tiny random-weight Qwen3-MoE (2 layers, 8 experts), made and
converted in ``root``: for the tests that need a real API server rather than a real model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flashmoe.tools.convert import convert_checkpoint
from flashmoe.tools.tiny_models import build_tiny_model
from tests.support.serving import Server
from tests.support.stores import TEST_BLOCK_SIZE, TEST_PARALLELISM


def tiny_serve(root: Path, *settings: str, damage: Callable[[Path], object] | None = None
               ) -> Server:
    """The server, ready (use it as a context manager to stop it). ``damage``: called with
    the store before the server starts (a bad block for a fault test)."""
    checkpoint = build_tiny_model("qwen3_moe", root / "hf", layers=2, experts=8, top_k=2,
                                  hidden=64, expert_intermediate=48)
    convert_checkpoint(checkpoint, root / "store", block_size=TEST_BLOCK_SIZE,
                       parallelism=TEST_PARALLELISM, show_progress=False)
    if damage is not None:
        damage(root / "store")
    return Server(root / "store", root / "home", "cache.capacity_experts=6", *settings)
