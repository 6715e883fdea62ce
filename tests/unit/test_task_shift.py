"""task-shift's drift comparison: drift handling on against off, whatever the default."""

import dataclasses

import numpy as np
import pytest

from common.config import FlashMoEConfig
from common.traces import Trace
from flashmoe.sim.device_model import DEVICES, MODEL_SHAPES
from flashmoe.bench.task_shift import task_shift


def two_task_trace() -> Trace:
    rng = np.random.default_rng(0)
    L, E, K, T = 4, 8, 2, 30
    rows = []
    for task in (0, 0, 1, 1):
        hot = np.arange(4) + 4 * task  # each task routes to its own half of the experts
        rows.append(np.stack([np.stack([rng.choice(hot, K, replace=False) for _ in range(L)])
                              for _ in range(T)]))
    experts = np.concatenate(rows).astype(np.int16)
    sequences = [{"dataset": name} for name in ("a", "a", "b", "b")]
    return Trace("two-tasks", experts, np.arange(0, 4 * T + 1, T), E, "olmoe-1b-7b",
                 sequences=sequences)


@pytest.mark.parametrize("drift_default", [False, True])
def test_task_shift_compares_drift_on_with_off(drift_default):
    config = FlashMoEConfig()
    config.predictor = dataclasses.replace(config.predictor, drift=drift_default)
    report = task_shift(two_task_trace(), 8, DEVICES["orin-980pro"], MODEL_SHAPES["olmoe-1b-7b"],
                        config, None, window=10, after=20, jobs=1)
    other = "ordered-nodrift" if drift_default else "ordered-drift"
    assert set(report["curves"]) == {"ordered", "shuffled", other}
    assert [s["dataset"] for s in report["switches"]] == ["a", "b"]
    (row,) = report["drift"]
    assert row["token"] == 60 and 0.0 <= row["with_drift"] <= 1.0
    assert 0.0 <= row["without_drift"] <= 1.0
