"""`flashmoe learner-cpu`: a row per pause and mode, the CPU a token split by stage."""

import pytest

from common.config import load_config
from common.traces import load_gptoss20b
from flashmoe.bench import learner_cpu

pytestmark = pytest.mark.traces


def test_a_row_per_pause_and_mode_with_the_stages():
    report = learner_cpu.measure(load_gptoss20b("dev"), load_config(env={}), None, [0, 2],
                                 tokens=6, start=300)
    assert [(r["pause_ms"], r["pause"]) for r in report["rows"]] == \
        [(0, "none"), (2, "sleep"), (2, "spin")]
    for row in report["rows"]:
        assert row["cpu_ms_per_token"] > 0 and row["wall_ms_per_token"] > 0
        assert {"extract", "infer", "train"} <= set(row["by_stage"])
    assert "2 ms spin" in learner_cpu.format_table(report)
