"""A store's precision copies: written beside the native experts (int8, int4), verified,
opened only with the experts they were made from."""

import json

import pytest

from common.store import ExpertStore, StoreError, stripe_name
from flashmoe.tools.store_writer import write_copies
from flashmoe.tools.synth_store import synth_store


def test_copies_are_verified_and_a_stale_or_broken_copy_is_refused_by_name(tmp_path):
    path = tmp_path / "s"
    synth_store(path, "gpt-oss-tiny", 0.5, show_progress=False).close()
    write_copies(path, ["int8", "int4"], show_progress=False)
    with ExpertStore.open(path) as store:
        assert store.precisions == ["native", "int8", "int4"]
        assert list(store.verify()) == []
        entry = store.at("int4").expert(3, 5)
        assert {t.name for t in entry.tensors} >= {"gate_up_proj", "gate_up_proj.scale"}
        assert entry.nbytes < store.expert(3, 5).nbytes / 3
        n_native = len(store.manifest.block_crc)
    # a flipped byte in the int8 copy: verify names the copy's block
    stripe = path / "int8" / stripe_name(0)
    data = bytearray(stripe.read_bytes())
    data[100] ^= 0xFF
    stripe.write_bytes(bytes(data))
    with ExpertStore.open(path) as store:
        errors = list(store.verify())
        assert len(errors) == 1 and "layer 0 expert 0" in str(errors[0])
    # the native experts made again (another seed): the copies are dropped, not served stale
    synth_store(path, "gpt-oss-tiny", 0.5, seed=1, show_progress=False).close()
    with ExpertStore.open(path) as store:
        assert store.precisions == ["native"] and len(store.manifest.block_crc) == n_native
        with pytest.raises(StoreError, match="--precisions"):
            store.at("int8")


def test_a_copy_from_other_experts_is_not_opened(tmp_path):
    path = tmp_path / "s"
    synth_store(path, "gpt-oss-tiny", 0.5, show_progress=False).close()
    write_copies(path, ["int8"], show_progress=False)
    manifest = path / "int8" / "manifest.json"
    text = manifest.read_text()
    doc = json.loads(text)
    doc["quant"]["source_digest"] = "00000000-1"
    manifest.write_text(json.dumps(doc))
    with ExpertStore.open(path) as store:
        assert "int8" not in store.copies and "stale" in store.copy_errors["int8"]
        errors = [str(e) for e in store.verify()]
        assert any("stale" in e for e in errors)
