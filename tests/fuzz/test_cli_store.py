"""Hostile stores: a manifest.json with any value swapped, missing, huge, negative, NaN or
deeply nested, any text or bytes as the manifest, and store files truncated or overwritten with
garbage. Opening and verifying such a store raises (or yields) StoreError and nothing else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.store import MANIFEST_NAME, ExpertStore, StoreError

HOSTILE_VALUES = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.sampled_from([0, -1, 1, 4095, 4096, 1 << 31, 1 << 32, 1 << 63, 1 << 64]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.integers(min_value=1, max_value=400).map(lambda depth: nested(depth)),  # deeper: text test
)


def nested(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def paths(node, prefix=()):
    """Every place in a JSON tree: (keys and indexes leading to it)."""
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node[:3]):  # the first few items stand for the rest
            yield from paths(value, prefix + (i,))


@pytest.fixture(scope="module")
def base_manifest(tiny_store) -> dict:
    return json.loads((tiny_store / MANIFEST_NAME).read_text())


@pytest.fixture(scope="module")  # shared by the examples: each restores what it damaged
def work_store(tiny_store, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz-store") / "store"
    shutil.copytree(tiny_store, out)
    return out


def open_and_verify(path: Path) -> None:
    """Only StoreError may come out: from opening, from reading every expert's plan, and from
    verifying every block."""
    try:
        store = ExpertStore.open(path)
    except StoreError:
        return
    with store:
        for layer, expert in store.keys():
            store.read_ops(layer, expert, 0)
        for error in store.verify():
            assert isinstance(error, StoreError)


def mutate(manifest: dict, data) -> dict:
    doc = json.loads(json.dumps(manifest))
    where = data.draw(st.sampled_from(list(paths(doc))[1:]), label="where")
    parent = doc
    for key in where[:-1]:
        parent = parent[key]
    if data.draw(st.booleans(), label="delete") and isinstance(parent, dict):
        del parent[where[-1]]
    else:
        parent[where[-1]] = data.draw(HOSTILE_VALUES, label="value")
    return doc


@given(data=st.data())
def test_a_manifest_with_a_hostile_value_is_a_store_error(base_manifest, work_store, data):
    doc = mutate(base_manifest, data)
    if data.draw(st.booleans(), label="twice"):
        doc = mutate(doc, data) if isinstance(doc, dict) else doc
    text = json.dumps(doc, allow_nan=True)
    (work_store / MANIFEST_NAME).write_text(text)
    open_and_verify(work_store)


@given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(
    lambda b: b.decode("latin-1")), st.integers(1, 200_000).map(lambda n: "[" * n),
    st.sampled_from(["null", "[]", "{}", "NaN", "1e999", '{"format_version": 2}'])))
def test_any_text_as_the_manifest_is_a_store_error(work_store, text):
    (work_store / MANIFEST_NAME).write_text(text, encoding="utf-8", errors="surrogatepass")
    with pytest.raises(StoreError):
        ExpertStore.open(work_store)


@given(data=st.data())
def test_truncated_or_garbage_store_files_are_store_errors(tiny_store, work_store, data):
    names = sorted(p.name for p in tiny_store.iterdir() if p.is_file())
    name = data.draw(st.sampled_from(names), label="file")
    original = (tiny_store / name).read_bytes()
    target = work_store / name
    (work_store / MANIFEST_NAME).write_bytes((tiny_store / MANIFEST_NAME).read_bytes())
    how = data.draw(st.sampled_from(["truncate", "garbage", "remove", "folder"]), label="how")
    try:
        if how == "truncate":
            target.write_bytes(original[:data.draw(st.integers(0, max(0, len(original) - 1)))])
        elif how == "garbage":
            at = data.draw(st.integers(0, max(0, len(original) - 1)), label="at")
            junk = data.draw(st.binary(min_size=1, max_size=64), label="junk")
            target.write_bytes(original[:at] + junk + original[at + len(junk):])
        elif how == "remove":
            target.unlink()
        else:
            target.unlink()
            target.mkdir()
        open_and_verify(work_store)
    finally:
        if target.is_dir():
            target.rmdir()
        target.write_bytes(original)

