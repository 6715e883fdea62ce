"""Fixtures (tiny real checkpoints, stores made from them, live cache managers) and the hooks:
the predictor's fused inference built once, and the `traces` marker resolved once. Helpers the
test modules share live in tests/support/."""

from __future__ import annotations

import flashmoe  # noqa: F401  (first: single-threaded BLAS, as in every FlashMoE process)
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flashmoe.tools.convert import convert_checkpoint  # noqa: E402
from flashmoe.tools.tiny_models import build_tiny_model  # noqa: E402
from tests.support.manager import ManagerHandle  # noqa: E402
from tests.support.stores import FAMILIES, TEST_BLOCK_SIZE, TEST_PARALLELISM  # noqa: E402
from tests.support.traces import missing_shared_traces  # noqa: E402


def pytest_configure(config) -> None:
    """The predictor's fused inference and the worker's expert kernels, rebuilt when their
    source is newer (as `flashmoe build-helper` does); without a compiler the tests that need
    them skip or take the torch path."""
    from common.cbuild import BuildError
    from services.inference_worker import quantized
    from services.predictor import fast_infer

    for helper in (fast_infer, quantized):
        try:
            helper.build()
        except BuildError:
            pass


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `traces` read the full shared traces; where they are absent, every one of
    them skips with the same reason."""
    marked = [item for item in items if item.get_closest_marker("traces")]
    if not marked:
        return
    reason = missing_shared_traces()
    if reason is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: build_tiny_model(family, root / family, layers=2, experts=8, top_k=2,
                                     hidden=64, expert_intermediate=48)
            for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_store(tiny_checkpoints, tmp_path_factory) -> Path:
    """A Qwen3-MoE store shared read-only by tests (copy it before damaging it)."""
    out = tmp_path_factory.mktemp("store") / "qwen3_moe"
    convert_checkpoint(tiny_checkpoints["qwen3_moe"], out, block_size=TEST_BLOCK_SIZE,
                       parallelism=TEST_PARALLELISM, show_progress=False)
    return out


@pytest.fixture
def store_copy(tiny_store, tmp_path) -> Path:
    out = tmp_path / "store"
    subprocess.run(["cp", "-r", str(tiny_store), str(out)], check=True)
    return out


@pytest.fixture
def start_manager(tmp_path):
    """Start cache-manager processes; every one is stopped at teardown."""
    handles = []

    def start(store: Path, *overrides: str, env: dict | None = None) -> ManagerHandle:
        runtime = tmp_path / f"run{len(handles)}"
        runtime.mkdir()
        handle = ManagerHandle(store, runtime, list(overrides), env)
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        handle.stop()

