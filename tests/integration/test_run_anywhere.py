"""`python -m flashmoe run` from a copy of the project with no ``../shared`` beside it: the main
job runs on the sample committed in the project, says so, and cleans up after itself."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.run_output import summary_of

ROOT = Path(__file__).resolve().parents[2]


def copy_of_the_project(dest: Path) -> Path:
    """The project's tracked files as a fresh clone has them (a clone of the working tree,
    uncommitted edits included), in a folder with no ``../shared`` beside it."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return dest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_main_job_runs_from_a_copy_with_no_shared_traces(tmp_path):
    project = copy_of_the_project(tmp_path / "elsewhere" / "project")
    assert not (project.parent.parent / "shared").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHMOE_")}
    env.update(PYTHONPATH=str(project), FLASHMOE_PANEL__PORT="0")
    done = subprocess.run([sys.executable, "-m", "flashmoe", "run", "--tokens", "20"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=840)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "replaying gptoss20b-sample:eval" in out and "the sample committed" in out, out
    assert "tokens of gptoss20b-sample:train" in out  # the warm-up came from the sample too
    summary = summary_of(done.stdout)
    assert float(summary["tokens"]) >= 19 and 0.0 < float(summary["hit_rate"]) <= 1.0, summary
    assert (project / ".flashmoe" / "run" / "warmup").exists()


def test_a_store_of_another_topology_runs_the_learner_cold(tmp_path):
    """`flashmoe run` on a store the default warm-up (gpt-oss-20b's routing) does not fit
    makes no checkpoint of that other shape: the learning services start cold."""
    from common.config import load_config
    from common.traces import SAMPLE_DIR
    from flashmoe.runtime.run import prepare, services
    from flashmoe.tools.synth_store import synth_store

    store = synth_store(tmp_path / "store", "qwen3-moe-1.7b", scale=0.02, block_size=8192,
                        parallelism=1, show_progress=False).path  # 16 layers x 64 experts
    said = []
    _, warmup = prepare(tmp_path / "home", load_config(env={}), str(store), None,
                        SAMPLE_DIR.parent, said.append)
    assert warmup is None and not (tmp_path / "home" / "warmup").exists()
    assert any("starts cold" in line and "16 MoE layers x 64 experts" in line for line in said), said
    specs = services(str(store), warmup, tmp_path, "warp:olmoe", 4, False, 0.0,
                     lambda service: f"ipc://{tmp_path}/{service}.sock")
    assert not any("--warmup" in spec.command for spec in specs)
