"""The store's errors and the typed reader of a manifest's JSON objects (common/store.py)."""

from __future__ import annotations

from typing import Any

BIG = 1 << 62  # bound of a manifest's integers (sizes, offsets, counts)


def stripe_name(k: int) -> str:
    return f"stripe_{k}.bin"


class StoreError(RuntimeError):
    """A store is missing, malformed, truncated or corrupt."""


class ChecksumError(StoreError):
    """A block's bytes do not match its recorded checksum."""

    def __init__(self, layer: int, expert: int, block: int, stripe: int, offset: int,
                 problem: str = "does not match its checksum") -> None:
        super().__init__(f"layer {layer} expert {expert}: block {block} ({stripe_name(stripe)} at "
                         f"byte offset {offset}) {problem}")
        self.layer, self.expert, self.block = layer, expert, block
        self.file, self.offset = stripe_name(stripe), offset


class FileCheckError(StoreError):
    """One of the store's side files (``SIDE_FILES``) is missing or differs from the manifest."""

    def __init__(self, file: str, problem: str) -> None:
        super().__init__(f"file {file} {problem}")
        self.file = file


class _Fields:
    """Typed reads of one JSON object of a manifest: a missing key, or a value of another type
    or out of range, is a StoreError naming where it is."""

    def __init__(self, data: Any, where: str, name: str) -> None:
        if not isinstance(data, dict):
            raise StoreError(f"{where}: manifest is malformed ({name} must be a JSON object, "
                             f"found {type(data).__name__})")
        self.data, self.where, self.name = data, where, name

    def value(self, key: str) -> Any:
        if key not in self.data:
            raise StoreError(f"{self.where}: manifest is malformed ({self.name} has no {key!r})")
        return self.data[key]

    def _bad(self, key: str, what: str) -> StoreError:
        return StoreError(f"{self.where}: manifest is malformed ({self.name}.{key} must be "
                          f"{what}, found {_short(self.data.get(key))})")

    def integer(self, key: str, lo: int = 0, hi: int = BIG) -> int:
        value = self.value(key)
        if type(value) is not int or not lo <= value <= hi:
            raise self._bad(key, f"an integer in [{lo}, {hi}]")
        return value

    def text(self, key: str) -> str:
        value = self.value(key)
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def array(self, key: str) -> list:
        value = self.value(key)
        if not isinstance(value, list):
            raise self._bad(key, "a list")
        return value

    def integers(self, key: str, lo: int = 0, hi: int = BIG) -> list:
        values = self.array(key)
        if not all(type(v) is int and lo <= v <= hi for v in values):
            raise self._bad(key, f"a list of integers in [{lo}, {hi}]")
        return values


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
