"""`flashmoe chaos` on its cheapest row (the feature extractor killed under `run`, one run):
the JSON has the promised shape with integer counts, the exit status agrees with the rows, and
the tool leaves nothing behind (no process, no arena in /dev/shm, no temporary folder). The
row's verdict itself is the matrix's business (`../shared/checks/hardening`), not asserted."""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from common.arena import SHM_DIR
from flashmoe.runtime.launch import child_env, cli_command

pytestmark = pytest.mark.slow
ROW_KEYS = {"fault", "target", "runs", "recovered", "hangs", "wrong_bytes", "leaks",
            "recover_s_p50", "recover_s_p99", "leak_detail"}
COUNTS = ("runs", "recovered", "hangs", "wrong_bytes", "leaks")


def processes_naming(text: str) -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in argv:
            out.append(f"{pid}: {argv.replace(chr(0), ' ')[:120]}")
    return out


@pytest.fixture
def short_tmp():
    """A temporary folder with a short path: the targets' ipc socket paths are made under it
    and must stay within 107 bytes, which pytest's own folders are too deep for."""
    folder = Path(tempfile.mkdtemp(prefix="fmc-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_one_row_reports_its_shape_and_leaves_nothing(tmp_path, short_tmp):
    arenas_before = {p.name for p in SHM_DIR.glob("flashmoe*")}
    tmp = short_tmp
    out = tmp_path / "chaos.json"
    done = subprocess.run(cli_command("chaos", "--faults", "kill-feature_extractor", "--targets",
                                      "run", "--runs", "1", "--json", str(out)),
                          env={**child_env(), "TMPDIR": str(tmp)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 1 and ROW_KEYS <= set(rows[0])
    row = rows[0]
    assert (row["fault"], row["target"], row["runs"]) == ("kill-feature_extractor", "run", 1)
    assert all(type(row[k]) is int for k in COUNTS) and 0 <= row["recovered"] <= 1
    assert not any("before it was ready" in note for note in row["notes"]), row["notes"]
    assert row["leaks"] == sum(v for k, v in row["leak_detail"].items() if k != "examples")
    clean = row["recovered"] == 1 and not (row["hangs"] or row["wrong_bytes"] or row["leaks"])
    assert done.returncode == (0 if clean else 1)
    assert "kill-feature_extractor" in done.stdout and "min" in done.stdout.splitlines()[-2]
    # nothing left: the chaos folder, its targets' processes, their arenas (torch's compile
    # cache, which torch keeps in the temporary folder of any process using it, is no leak)
    assert [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")] == []
    assert processes_naming(str(tmp)) == []
    new_arenas = {p.name for p in SHM_DIR.glob("flashmoe*")} - arenas_before
    dead_owners = [n for n in new_arenas if not Path(f"/proc/{n.split('-')[-2]}").exists()]
    assert dead_owners == []


def test_the_loop_disk_is_a_device_of_its_own_and_goes_away(tmp_path):
    """``slow-read``'s store copy lives on a loop device: throttling that device's reads slows
    the store and not the program's files. Closing it unmounts it and deletes its image."""
    from flashmoe.bench.chaos_procs import LoopDisk

    try:
        disk = LoopDisk(tmp_path / "disk.img", tmp_path / "disk", 16 << 20)
    except OSError as exc:
        pytest.skip(f"no loop device here: {exc}")
    try:
        (disk.mount / "f").write_bytes(b"x" * 4096)
        here, there = os.stat(tmp_path).st_dev, os.stat(disk.mount / "f").st_dev
        assert here != there and os.major(there) == 7  # the loop driver's major number
    finally:
        disk.close()
    assert not os.path.ismount(disk.mount) and not (tmp_path / "disk.img").exists()
