"""Store format: conversion of each family is bit-exact; damage gives clear errors."""

import io
import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from common.arena import Arena
from common.model_families import UnsupportedModelError
from common.safetensors_io import read_header, write_safetensors
from common.store import (ALIGN, CONFIG_NAME, FORMAT_VERSION, MANIFEST_NAME, NON_EXPERT_NAME,
                          ExpertStore, FileCheckError, StoreError, block_location, stripe_name)
from flashmoe.cli import main as cli
from flashmoe.tools.convert import convert_checkpoint
from services.cache_manager.io_engine import PreadEngine
from services.inference_worker.generate import load_tokenizer
from tests.support.stores import (FAMILIES, TEST_BLOCK_SIZE, TEST_PARALLELISM,
                                  expected_expert_tensors)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_expert_reads_back_bit_identical(family, tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints[family]
    convert_checkpoint(ckpt, tmp_path / "s", block_size=TEST_BLOCK_SIZE,
                       parallelism=TEST_PARALLELISM, show_progress=False)
    store = ExpertStore.open(tmp_path / "s")
    assert store.manifest.model_family == family
    assert len(store.keys()) == 2 * 8 and store.manifest.top_k == 2
    arena = Arena.create(1, store.manifest.slot_bytes)
    engine = PreadEngine(arena.mmap, arena.slot_bytes, 1, store.stripe_paths, depth=2)
    try:
        for layer, expert in store.keys():
            ops = store.read_ops(layer, expert, slot=0)
            engine.read(ops)
            assert (ops["result"] == ops["length"]).all()
            store.verify_expert_bytes(layer, expert, arena.slot(0))
            got = arena.torch_views(0, store.expert(layer, expert))
            want = expected_expert_tensors(ckpt, store, layer, expert)
            assert set(got) == set(want) and len(got) == 3
            raw = arena.numpy_views(0, store.expert(layer, expert))  # bf16 as raw uint16
            for name in want:
                assert got[name].dtype == want[name].dtype == torch.bfloat16
                assert torch.equal(got[name].view(torch.int16), want[name].view(torch.int16))
                assert raw[name].shape == tuple(want[name].shape)
                assert raw[name].tobytes() == want[name].view(torch.int16).numpy().tobytes()
            del got, raw
    finally:
        engine.close()
        arena.close()


def test_layout_stripes_alignment_and_non_expert_weights(tiny_store):
    store = ExpertStore.open(tiny_store)
    m = store.manifest
    blocks_per_stripe = [0] * m.parallelism
    for e in m.experts:
        assert e.n_blocks >= 2, "tests need experts spanning several blocks"
        ops = store.read_ops(e.layer, e.expert, slot=0)
        for i, op in enumerate(ops):
            stripe, offset = block_location(e.first_block + i, m.block_size, m.parallelism)
            assert (op["file_index"], op["file_offset"]) == (stripe, offset)
            assert stripe == (e.first_block + i) % m.parallelism
            assert offset % ALIGN == 0 and op["length"] % ALIGN == 0
            blocks_per_stripe[stripe] += 1
    assert min(blocks_per_stripe) > 0
    # Several loads in one batch: the same reads, each load's slot, ends marking each load.
    items = [(e.layer, e.expert, slot) for slot, e in enumerate(m.experts[:3])]
    ops, ends = store.read_ops_batch(items)
    parts = [store.read_ops(*item) for item in items]
    assert ends == list(np.cumsum([len(part) for part in parts]))
    assert ops.tobytes() == np.concatenate(parts).tobytes()
    manifest = json.loads((tiny_store / MANIFEST_NAME).read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 2 and manifest["alignment"] == 4096
    assert (tiny_store / "non_expert.safetensors").stat().st_size > 0
    assert (tiny_store / "config.json").is_file()
    files = {f["file"]: (f["size"], f["crc32"]) for f in manifest["files"]}
    assert set(files) == {NON_EXPERT_NAME, CONFIG_NAME}
    for name, (size, crc) in files.items():
        data = (tiny_store / name).read_bytes()
        assert (size, crc) == (len(data), zlib.crc32(data))


def test_missing_manifest_does_not_open(store_copy):
    (store_copy / MANIFEST_NAME).unlink()
    with pytest.raises(StoreError, match="no manifest.json"):
        ExpertStore.open(store_copy)


def test_wrong_format_version_does_not_open(store_copy):
    path = store_copy / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["format_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(StoreError, match="format version 99"):
        ExpertStore.open(store_copy)


def test_previous_format_version_asks_for_a_reconversion(store_copy):
    path = store_copy / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["format_version"] = 1
    del data["files"]
    path.write_text(json.dumps(data))
    with pytest.raises(StoreError, match=r"format version 1 is not supported \(this build reads "
                                         r"version 2\); re-run `flashmoe convert`"):
        ExpertStore.open(store_copy)


def _edit_expert(store: Path, index: int, edit) -> None:
    path = store / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data["experts"][index], data)
    path.write_text(json.dumps(data))


def _shift_tensor(offset_delta):
    def edit(expert, _):
        expert["tensors"][-1]["offset"] += offset_delta(expert)
    return edit


def _grow_shape(expert, _):
    expert["tensors"][0]["shape"][0] += 1


def _overlap(expert, _):
    expert["tensors"][1]["offset"] = expert["tensors"][0]["offset"] + 256


def _rename_tensor(expert, _):
    expert["tensors"][1]["name"] = expert["tensors"][0]["name"]


def _duplicate_key(expert, data):
    expert["layer"], expert["expert"] = data["experts"][2]["layer"], data["experts"][2]["expert"]


@pytest.mark.parametrize("edit, message", [
    (_shift_tensor(lambda e: e["nbytes"]), r"tensor \w+ \(offset \d+, \d+ bytes\) does not lie "
                                           r"inside the expert's \d+ bytes"),
    (_shift_tensor(lambda e: -e["tensors"][-1]["offset"] - 256), "does not lie inside"),
    (_grow_shape, r"tensor \w+ is \d+ bytes, but BF16 \[\d+, \d+\] is \d+"),
    (_overlap, r"tensors \w+ and \w+ overlap"),
    (_rename_tensor, r"lists tensor\(s\) \w+ more than once"),
    (_duplicate_key, r"is listed twice"),
])
def test_manifest_tensor_extents_and_keys_are_validated(store_copy, edit, message):
    store = ExpertStore.open(store_copy)
    expert = store.manifest.experts[3]
    named = store.manifest.experts[2] if edit is _duplicate_key else expert
    _edit_expert(store_copy, 3, edit)
    with pytest.raises(StoreError, match=message) as err:
        ExpertStore.open(store_copy)
    assert f"layer {named.layer} expert {named.expert}" in str(err.value)


def test_malformed_manifest_is_a_clear_error(store_copy):
    (store_copy / MANIFEST_NAME).write_text('{"format_version": 1}')
    with pytest.raises(StoreError, match="malformed"):
        ExpertStore.open(store_copy)
    (store_copy / MANIFEST_NAME).write_text("{trunc")
    with pytest.raises(StoreError, match="not valid JSON"):
        ExpertStore.open(store_copy)


@pytest.mark.parametrize("name", [NON_EXPERT_NAME, CONFIG_NAME])
def test_side_file_of_the_wrong_size_or_missing_does_not_open(store_copy, name):
    path = store_copy / name
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b" ")
    with pytest.raises(StoreError, match=f"file {name} is {size + 1} bytes, the manifest says "
                                         f"{size}"):
        ExpertStore.open(store_copy)
    path.unlink()
    with pytest.raises(StoreError, match=f"file {name} is missing"):
        ExpertStore.open(store_copy)


@pytest.mark.parametrize("name", [NON_EXPERT_NAME, CONFIG_NAME])
def test_side_file_with_a_changed_byte_is_named_by_verify(store_copy, name, capsys):
    path = store_copy / name
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x01  # same size: opening (sizes only) cannot tell
    path.write_bytes(bytes(data))
    store = ExpertStore.open(store_copy)
    errors = list(store.verify())
    assert len(errors) == 1 and isinstance(errors[0], FileCheckError)
    assert errors[0].file == name and "does not match its checksum" in str(errors[0])
    assert cli(["verify", str(store_copy), "--quiet"]) == 1
    assert f"file {name} does not match its checksum" in capsys.readouterr().err


def test_truncated_stripe_is_named(store_copy, capsys):
    stripe = store_copy / stripe_name(1)
    os.truncate(stripe, stripe.stat().st_size - 4096)
    with pytest.raises(StoreError, match="stripe_1.bin is truncated"):
        ExpertStore.open(store_copy)
    assert cli(["verify", str(store_copy), "--quiet"]) == 2
    assert "stripe_1.bin is truncated" in capsys.readouterr().err


def test_flipped_byte_is_named_by_verify(store_copy, capsys):
    store = ExpertStore.open(store_copy)
    victim = store.manifest.experts[5]
    block = victim.first_block + 1
    stripe, offset = block_location(block, store.manifest.block_size, store.manifest.parallelism)
    with open(store_copy / stripe_name(stripe), "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    errors = list(store.verify())
    assert len(errors) == 1 and errors[0].block == block
    assert cli(["verify", str(store_copy), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"block {block} " in err and f"layer {victim.layer} expert {victim.expert}" in err


def test_verify_ok_exits_zero(tiny_store, capsys):
    assert cli(["verify", str(tiny_store), "--quiet"]) == 0
    assert "blocks OK" in capsys.readouterr().out


def test_unsupported_family_is_a_clear_error(tiny_checkpoints, tmp_path, capsys):
    ckpt = tmp_path / "llama"
    shutil.copytree(tiny_checkpoints["olmoe"], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'llama' is not a supported MoE family"):
        convert_checkpoint(ckpt, tmp_path / "s", show_progress=False)
    assert cli(["convert", str(ckpt), str(tmp_path / "s2"), "--quiet"]) == 2
    assert "not a supported MoE family" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["gpt_oss", "olmoe"])
def test_a_tiny_models_chat_template_reaches_the_converted_store(family, tmp_path, capsys):
    ckpt, store = tmp_path / "ckpt", tmp_path / "store"
    assert cli(["make-tiny-model", family, str(ckpt), "--experts", "4",
                "--expert-intermediate", "16"]) == 0
    assert cli(["convert", str(ckpt), str(store), "--quiet"]) == 0
    assert (store / "chat_template.jinja").is_file()
    tokenizer = load_tokenizer(store)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text == ("<|bos|>system\nBe brief.<|eos|>\n<|bos|>user\nHi<|eos|>\n"
                    "<|bos|>assistant\n")
    ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    assert ids[0] == 0 and ids.count(0) == 2 and ids.count(1) == 2  # BOS and EOS per message
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<|bos|>user\nHi<|eos|>\n"


def test_not_a_checkpoint_folder(tmp_path, capsys):
    assert cli(["convert", str(tmp_path), str(tmp_path / "s"), "--quiet"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_reconvert_over_a_store_replaces_it_atomically(tiny_checkpoints, tmp_path):
    out = tmp_path / "s"
    convert_checkpoint(tiny_checkpoints["mixtral"], out, block_size=8192, parallelism=2,
                       show_progress=False)
    convert_checkpoint(tiny_checkpoints["olmoe"], out, block_size=4096, parallelism=4,
                       show_progress=False)
    store = ExpertStore.open(out)
    assert store.manifest.model_family == "olmoe" and store.manifest.parallelism == 4
    assert next(store.verify(), None) is None
    assert not (out / (MANIFEST_NAME + ".tmp")).exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal_and_only_when_asked(tiny_checkpoints, tmp_path,
                                                             monkeypatch, capsys):
    ckpt = tiny_checkpoints["olmoe"]
    convert_checkpoint(ckpt, tmp_path / "a", block_size=TEST_BLOCK_SIZE, show_progress=True)
    assert capsys.readouterr().err == ""  # pytest's captured stderr is not a terminal
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    convert_checkpoint(ckpt, tmp_path / "b", block_size=TEST_BLOCK_SIZE, show_progress=False)
    assert terminal.getvalue() == ""
    convert_checkpoint(ckpt, tmp_path / "c", block_size=TEST_BLOCK_SIZE, show_progress=True)
    assert "convert" in terminal.getvalue()


def test_checkpoint_tensor_whose_bytes_disagree_with_its_shape_is_refused(tiny_checkpoints,
                                                                          tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["olmoe"], ckpt)
    damaged = None
    for path in sorted(ckpt.glob("*.safetensors")):
        refs = read_header(path)
        items = [(r.name, r.dtype, r.shape, path.read_bytes()[r.start:r.start + r.nbytes])
                 for r in refs.values()]
        for i, (name, dtype, shape, data) in enumerate(items):
            if damaged is None and ".experts.5." in name and name.startswith("model.layers.1."):
                items[i] = (name, dtype, (shape[0] + 1, *shape[1:]), data)
                damaged = name
        write_safetensors(path, items)
    assert damaged is not None
    with pytest.raises(StoreError, match="layer 1 expert 5: tensor \\w+ is \\d+ bytes, but"):
        convert_checkpoint(ckpt, tmp_path / "s", show_progress=False)
    assert not (tmp_path / "s" / MANIFEST_NAME).exists()


def test_bad_block_size_is_rejected(tiny_checkpoints, tmp_path):
    with pytest.raises(ValueError, match="multiple of 4096"):
        convert_checkpoint(tiny_checkpoints["olmoe"], tmp_path / "s", block_size=5000)
