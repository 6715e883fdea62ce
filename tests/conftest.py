"""Shared fixtures: tiny real checkpoints, stores made from them, a live cache manager."""

from __future__ import annotations

import flashmoe  # noqa: F401  (first: single-threaded BLAS, as in every FlashMoE process)
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common.store import ExpertStore  # noqa: E402
from flashmoe.tools.convert import convert_checkpoint  # noqa: E402
from common.bus import control_endpoint_for, ipc_endpoint  # noqa: E402
from flashmoe.runtime.launch import start_cache_manager, stop_process  # noqa: E402
from flashmoe.tools.tiny_models import build_tiny_model  # noqa: E402


def pytest_configure(config) -> None:
    """The predictor's fused inference, rebuilt when its source is newer (as `flashmoe
    build-helper` does); without a compiler the tests that need it skip."""
    from common.cbuild import BuildError
    from services.predictor import fast_infer

    try:
        fast_infer.build()
    except BuildError:
        pass

FAMILIES = ("qwen3_moe", "olmoe", "mixtral")
# Small blocks so that every expert spans several blocks and every stripe.
TEST_BLOCK_SIZE = 8192
TEST_PARALLELISM = 3


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


class ManagerHandle:
    def __init__(self, store: Path, runtime: Path, overrides: list[str],
                 env: dict | None = None) -> None:
        self.endpoint = ipc_endpoint(runtime, "cache")
        self.control = control_endpoint_for(self.endpoint)
        self.log_path = runtime / "cache_manager.log"
        self._log = open(self.log_path, "w")
        self.proc = start_cache_manager(store, self.endpoint, overrides, log_file=self._log,
                                        env=env)

    def stats(self) -> dict:
        from common.bus import stats

        return stats(self.control)

    def wait_for(self, condition, timeout_s: float = 20.0, what: str = "") -> dict:
        """Poll the control socket's stats until ``condition(stats)`` holds."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            current = self.stats()
            if condition(current):
                return current
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what or condition}: {current}")
            time.sleep(0.05)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> int:
        rc = stop_process(self.proc)
        self._log.close()
        return rc


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


def uring_available() -> tuple[bool, str]:
    """(True, "") when the helper is built (rebuilt here when its source is newer), loads, and
    this process may set up an io_uring instance; else (False, why)."""
    from services.cache_manager.io_engine import IOEngineError, build_helper, probe_uring

    try:
        build_helper()
        probe_uring()
        return True, ""
    except IOEngineError as exc:
        return False, str(exc)


def expected_expert_tensors(checkpoint: Path, store: ExpertStore, layer: int, expert: int) -> dict:
    """The checkpoint's own tensors for one expert, read with the safetensors library."""
    from safetensors import safe_open

    out = {}
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            for t in store.expert(layer, expert).tensors:
                if t.key in keys:
                    out[t.name] = f.get_tensor(t.key)
    return out
