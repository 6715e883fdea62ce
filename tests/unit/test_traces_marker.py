"""The `traces` marker's resolution: conftest skips every test it marks, with the one reason
given here, where the shared traces are absent, and runs them where they are present."""

import pytest

from tests.support.traces import missing_shared_traces


def test_absent_shared_traces_give_one_reason_naming_the_folder_and_the_families(tmp_path):
    nowhere = tmp_path / "nowhere"
    assert missing_shared_traces(nowhere) == \
        f"needs the shared traces: gptoss20b/, warp/ not found in {nowhere}"
    (tmp_path / "gptoss20b").mkdir()
    assert missing_shared_traces(tmp_path) == \
        f"needs the shared traces: warp/ not found in {tmp_path}"


def test_a_folder_with_every_family_runs_the_marked_tests(tmp_path):
    (tmp_path / "gptoss20b").mkdir()
    (tmp_path / "warp").mkdir()
    assert missing_shared_traces(tmp_path) is None


@pytest.mark.traces
def test_a_marked_test_runs_only_where_the_shared_traces_are():
    assert missing_shared_traces() is None
