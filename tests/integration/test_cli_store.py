"""`convert`, `synth-store` and `verify` as a user meets them: a target that holds something is
refused and left exactly as it was, every flag is checked in its own words, a store that a
running process has open is never rewritten under it, and a bad block is named precisely."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.store import ExpertStore, StoreError, stripe_name, write_lock
from flashmoe.cli.main import main
from tests.support.stores import TEST_BLOCK_SIZE, TEST_PARALLELISM

ROOT = Path(__file__).resolve().parents[2]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by relative path, with a hash of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def run_cli(capsys, *argv: str) -> tuple[int, list[str]]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.fixture
def hf(tiny_checkpoints) -> Path:
    return tiny_checkpoints["qwen3_moe"]


def convert(capsys, hf: Path, out: Path, *flags: str) -> tuple[int, list[str]]:
    return run_cli(capsys, "convert", "--quiet", str(hf), str(out), "--block-size",
                   str(TEST_BLOCK_SIZE), "--parallelism", str(TEST_PARALLELISM), *flags)


def test_convert_into_a_folder_holding_a_config_json_changes_nothing(capsys, hf, tmp_path):
    """Swapped arguments used to overwrite a checkpoint folder's config.json and tokenizer."""
    target = tmp_path / "keep"
    target.mkdir()
    (target / "config.json").write_text("precious")
    (target / "tokenizer.json").write_text("also precious")
    before = snapshot(target)
    rc, err = convert(capsys, hf, target)
    assert rc == 2 and len(err) == 1
    assert "holds a config.json" in err[0] and "--force" in err[0]
    assert snapshot(target) == before


def test_convert_into_a_non_empty_folder_or_a_store_needs_force(capsys, hf, tmp_path):
    target = tmp_path / "full"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    rc, err = convert(capsys, hf, target)
    assert rc == 2 and "is not empty" in err[0] and snapshot(target) == {
        "notes.txt": hashlib.sha256(b"mine").hexdigest()}

    store = tmp_path / "store"
    assert convert(capsys, hf, store)[0] == 0
    before = snapshot(store)
    rc, err = convert(capsys, hf, store, "--block-size", "4096")
    assert rc == 2 and "already holds a FlashMoE store" in err[0]
    assert snapshot(store) == before
    assert convert(capsys, hf, store, "--block-size", "4096", "--force")[0] == 0
    assert ExpertStore.open(store).manifest.block_size == 4096


def test_the_checkpoint_folder_is_never_its_own_target(capsys, hf, tmp_path):
    folder = tmp_path / "hf"
    subprocess.run(["cp", "-r", str(hf), str(folder)], check=True)
    before = snapshot(folder)
    rc, err = run_cli(capsys, "convert", "--quiet", "--force", str(folder), str(folder) + "/")
    assert rc == 2 and "is the checkpoint folder itself" in err[0]
    assert snapshot(folder) == before


@pytest.mark.parametrize("flags, says", [
    (["--parallelism", "0"], "store.parallelism (from --parallelism 0) = 0 is out of range"),
    (["--block-size", "1000"], "store.block_size (from --block-size 1000) = 1000 is out of range"),
    (["--block-size", "6K"], "(from --block-size 6K) = 6144 must be a multiple of 4096"),
    (["--block-size", "lots"], "(from --block-size lots): not a size"),
])
def test_convert_names_the_flag_the_user_typed(capsys, hf, tmp_path, flags, says):
    """--parallelism 0 used to build 4 stripes; a bad --block-size named a --set."""
    rc, err = run_cli(capsys, "convert", "--quiet", str(hf), str(tmp_path / "s"), *flags)
    assert rc == 2 and len(err) == 1 and says in err[0] and "--set" not in err[0]
    assert not (tmp_path / "s").exists()


def test_convert_of_a_missing_checkpoint_says_so(capsys, tmp_path):
    rc, err = run_cli(capsys, "convert", str(tmp_path / "nope"), str(tmp_path / "s"))
    assert rc == 2 and "no such checkpoint folder" in err[0]


def test_make_tiny_model_checks_its_flags(capsys, tmp_path):
    rc, err = run_cli(capsys, "make-tiny-model", "qwen3_moe", str(tmp_path / "m"), "--experts", "0")
    assert rc == 2 and "--experts: must be at least 1" in err[0]
    rc, err = run_cli(capsys, "make-tiny-model", "qwen3_moe", str(tmp_path / "m"), "--experts", "2",
                      "--top-k", "3")
    assert rc == 2 and "--top-k 3" in err[0]
    assert not (tmp_path / "m").exists()


HOLD = """
import sys
from common.store import ExpertStore
store = ExpertStore.open(sys.argv[1])
print("open", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def hold_open():
    """Start a real process that holds a store open until the test ends."""
    held = []

    def start(store: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(store)], cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        held.append(proc)
        assert proc.stdout.readline().strip() == "open"
        return proc

    yield start
    for proc in held:
        proc.stdin.close()
        proc.wait(timeout=60)


def test_a_store_open_in_another_process_is_not_rewritten(capsys, hf, tmp_path, hold_open):
    """A second `run` with another block size used to rewrite the store under the first."""
    store = tmp_path / "store"
    assert convert(capsys, hf, store)[0] == 0
    before = snapshot(store)
    holder = hold_open(store)
    rc, err = convert(capsys, hf, store, "--block-size", "4096", "--force")
    assert rc == 2 and err == [f"flashmoe convert: error: the store at {store} is open by a "
                               f"running FlashMoE process; stop it first"]
    assert snapshot(store) == before
    with ExpertStore.open(store):  # readers share the store
        pass
    holder.stdin.close()
    holder.wait(timeout=60)
    assert convert(capsys, hf, store, "--block-size", "4096", "--force")[0] == 0
    assert ExpertStore.open(store).manifest.block_size == 4096


def test_synth_store_refuses_a_store_open_elsewhere_and_a_foreign_folder(capsys, tmp_path,
                                                                        hold_open):
    store = tmp_path / "synth"
    made = ["synth-store", str(store), "--shape", "gpt-oss-tiny", "--scale", "1", "--quiet",
            "--block-size", "8K"]
    assert run_cli(capsys, *made)[0] == 0
    before = snapshot(store)
    hold_open(store)
    assert run_cli(capsys, *made)[0] == 0  # the same store: reused, not written
    rc, err = run_cli(capsys, *made[:-1], "4K")
    assert rc == 2 and "is open by a running FlashMoE process" in err[0]
    assert snapshot(store) == before

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    rc, err = run_cli(capsys, "synth-store", str(foreign), "--shape", "gpt-oss-tiny", "--quiet")
    assert rc == 2 and "holds no synthetic store" in err[0]
    assert snapshot(foreign) == {"config.json": hashlib.sha256(b"{}").hexdigest()}
    rc, err = run_cli(capsys, "synth-store", str(tmp_path / "s2"), "--scale", "0")
    assert rc == 2 and "--scale 0.0: must be in (0, 1]" in err[0]


def test_a_store_being_written_does_not_open_and_has_one_writer(store_copy):
    with write_lock(store_copy):
        with pytest.raises(StoreError, match="is being written"):
            ExpertStore.open(store_copy)
        with pytest.raises(StoreError, match="is being written by another process"):
            with write_lock(store_copy):
                pass
    store = ExpertStore.open(store_copy)
    with pytest.raises(StoreError, match="is open by a running FlashMoE process"):
        with write_lock(store_copy):
            pass
    store.close()
    with write_lock(store_copy):
        pass


def test_verify_names_the_bad_block(capsys, store_copy):
    store = ExpertStore.open(store_copy)
    expert = store.manifest.experts[5]
    block = expert.first_block + 1
    stripe, offset = block % TEST_PARALLELISM, (block // TEST_PARALLELISM) * TEST_BLOCK_SIZE
    store.close()
    with open(store_copy / stripe_name(stripe), "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    rc = main(["verify", "--quiet", str(store_copy)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err == [f"{store_copy}: layer {expert.layer} expert {expert.expert}: block {block} "
                   f"({stripe_name(stripe)} at byte offset {offset}) does not match its "
                   f"checksum"]



@pytest.mark.parametrize("edit, says", [
    ({"block_size": 1 << 40}, "block_size 1099511627776 is over"),
    ({"num_experts": 1 << 40}, "num_experts 1099511627776"),
    ({"num_layers": 0}, "num_layers 0"),
    ({"top_k": 99}, "top_k 99"),
    ({"moe_layers": [1, 0]}, "must be increasing layer numbers"),
])
def test_a_manifest_of_impossible_counts_is_a_store_error(store_copy, edit, says):
    """Values each well-typed but impossible together (a block size no read length holds, more
    experts than any array should be made for) are refused before anything is sized by them."""
    path = store_copy / "manifest.json"
    doc = json.loads(path.read_text())
    doc.update(edit)
    path.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match=says):
        ExpertStore.open(store_copy)


def test_the_lock_goes_with_the_store_object(store_copy):
    store = ExpertStore.open(store_copy)
    with pytest.raises(StoreError, match="is open by a running FlashMoE process"):
        with write_lock(store_copy):
            pass
    del store  # garbage: its lock is released
    with write_lock(store_copy):
        pass
    with ExpertStore.open(store_copy):
        pass
    with write_lock(store_copy):  # closed by the with block
        pass


@pytest.fixture
def read_only_mount(tmp_path):
    """A read-only bind mount of a folder (root only); unmounted after the test."""
    def mount(folder: Path) -> Path:
        target = tmp_path / "ro"
        target.mkdir()
        for args in (["--bind", str(folder), str(target)],
                     ["-o", "remount,bind,ro", str(target)]):
            out = subprocess.run(["mount", *args], capture_output=True, text=True)
            if out.returncode != 0:
                subprocess.run(["umount", str(target)], capture_output=True)
                pytest.skip(f"cannot make a read-only bind mount here: {out.stderr.strip()}")
        mounted.append(target)
        return target

    mounted: list[Path] = []
    yield mount
    for target in mounted:
        subprocess.run(["umount", str(target)], check=True)


def test_a_store_on_a_read_only_mount_is_read_and_not_written(capsys, hf, store_copy, tmp_path,
                                                            read_only_mount):
    """A store is only read (its lock is a shared flock on the manifest): verify and generate
    work on a read-only mount; convert --force onto it fails with one line and changes nothing."""
    ro = read_only_mount(store_copy)
    rc, err = run_cli(capsys, "verify", str(ro))
    assert rc == 0, err
    out = subprocess.run([sys.executable, "-m", "flashmoe", "generate", "--store", str(ro),
                          "--prompt", "hello", "--max-new-tokens", "3",
                          "--home", str(tmp_path / "home")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "3 new tokens" in out.stderr
    rc, err = convert(capsys, hf, ro, "--force")
    assert rc != 0 and len(err) == 1 and "Read-only file system" in err[0], err
    assert snapshot(ro) == snapshot(store_copy)


def test_convert_and_synth_store_write_the_precisions_asked_for(capsys, hf, tmp_path):
    store = tmp_path / "store"
    assert main(["convert", str(hf), str(store), "--precisions", "bf16,int8", "--quiet"]) == 0
    assert "int8 copies written" in capsys.readouterr().out
    with ExpertStore.open(store) as opened:
        assert opened.precisions == ["native", "int8"]
    assert main(["verify", str(store), "--quiet"]) == 0
    assert "int8 copy" in capsys.readouterr().out
    synth = tmp_path / "synth"
    assert run_cli(capsys, "synth-store", str(synth), "--shape", "gpt-oss-tiny", "--quiet")[0] == 0
    # an existing store gets the copies it lacks, its native experts untouched
    before = snapshot(synth)
    assert run_cli(capsys, "synth-store", str(synth), "--shape", "gpt-oss-tiny",
                   "--precisions", "bf16,int8,int4", "--quiet")[0] == 0
    after = snapshot(synth)
    assert {k: v for k, v in after.items() if "/" not in k} == before
    assert {k.split("/")[0] for k in after if "/" in k} == {"int8", "int4"}
    rc, errors = run_cli(capsys, "synth-store", str(synth), "--precisions", "int2")
    assert rc == 2 and any("int2" in e for e in errors)
