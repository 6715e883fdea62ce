"""Learned state on disk: durable replacement of a file, resuming a service from the first of
its checkpoint folders that fits, and what happens when the disk or a checkpoint is bad.

A checkpoint file is written under a temporary name, synced, renamed over the old one and its
folder synced: a kill or a power cut leaves the last whole file, never a torn one. A write that
fails (a full disk, any ``OSError``) removes its temporary file and raises; the services skip
that checkpoint with a warning (``Throttle``), keep the previous one and go on learning.

A checkpoint that cannot be decoded (zero-length, truncated, garbage, arrays of the wrong
shape or names) is ``CheckpointDamaged``: in the service's own folder its files are moved
aside (``<name>.damaged``) with one warning and learning starts cold. A whole checkpoint made
for another model or network is ``CheckpointMismatch``: skipped, kept.

Testing only: ``FLASHMOE_CHECKPOINT_FAULT=enospc`` in a service's environment makes every
checkpoint write of the predictor and the feature extractor fail with ``ENOSPC`` (armed by the
service at start, ``arm_checkpoint_fault``, which says so loudly).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

FAULT_ENV = "FLASHMOE_CHECKPOINT_FAULT"
FAULT_KINDS = ("enospc",)
DAMAGED_SUFFIX = ".damaged"
_fault = ""  # the armed fault kind ("" = none)


class CheckpointDamaged(ValueError):
    """A checkpoint that cannot be decoded: zero-length, truncated, garbage, wrong arrays."""


class CheckpointMismatch(ValueError):
    """A whole checkpoint made for another model's shape or another network."""


def arm_checkpoint_fault(log: logging.Logger, env: dict | None = None) -> str:
    """Arm ``FLASHMOE_CHECKPOINT_FAULT`` for this process's checkpoint writes (a service calls
    this once at start); returns the kind armed ("" for none). An unknown kind is an error."""
    global _fault
    kind = (os.environ if env is None else env).get(FAULT_ENV, "").strip().lower()
    if kind and kind not in FAULT_KINDS:
        raise ValueError(f"{FAULT_ENV}={kind!r}: known kinds are {', '.join(FAULT_KINDS)}")
    _fault = kind
    if kind:
        log.warning("FAULT INJECTION (testing only): %s=%s makes every checkpoint write fail "
                    "with ENOSPC", FAULT_ENV, kind)
    return kind


def read_checkpoint(folder: str | Path, name: str, framework: str) -> tuple[dict, dict]:
    """``<folder>/<name>.safetensors`` as (its JSON, its arrays): the JSON from the file's
    ``name`` metadata, else from ``<name>.json`` beside it. FileNotFoundError when the file is
    missing; CheckpointDamaged when the bytes are not a checkpoint (zero-length, truncated,
    garbage, no JSON)."""
    from safetensors import safe_open

    folder = Path(folder)
    path = folder / f"{name}.safetensors"
    if not path.is_file():
        raise FileNotFoundError(2, f"no {name} checkpoint", str(path))
    try:
        with safe_open(str(path), framework=framework) as f:
            text = (f.metadata() or {}).get(name)
            arrays = {key: f.get_tensor(key) for key in f.keys()}
        return json.loads(text if text is not None else
                          (folder / f"{name}.json").read_text()), arrays
    except Exception as exc:  # SafetensorError, JSON, OS errors: the bytes are not a checkpoint
        raise CheckpointDamaged(f"{path}: {type(exc).__name__}: {exc}") from None


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, target: Path) -> None:
    """Sync ``tmp``, rename it over ``target`` and sync their folder."""
    fsync_path(tmp)
    os.replace(tmp, target)
    fsync_path(target.parent)


def write_durably(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` then replace ``path`` with it durably; on any failure the temporary file
    is removed and the error raised (``path`` keeps its previous content)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        if _fault == "enospc":
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected by {FAULT_ENV})",
                          str(tmp))
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_durably(path: Path, text: str) -> None:
    write_durably(path, lambda tmp: tmp.write_text(text))


def move_aside(folder: Path, names: tuple[str, ...]) -> list[str]:
    """Rename the ``names`` present in ``folder`` to ``<name>.damaged`` (replacing an older
    one); returns those moved."""
    moved = []
    for name in names:
        path = Path(folder) / name
        if path.exists():
            os.replace(path, path.with_name(name + DAMAGED_SUFFIX))
            moved.append(name)
    if moved:
        fsync_path(Path(folder))
    return moved


class Throttle:
    """A warning a service may repeat (a failing disk, dropped messages), logged at most once
    per ``every_s`` with the number of times it was held back since."""

    def __init__(self, log: logging.Logger, every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.every_s, self.clock = log, every_s, clock
        self.next_at = float("-inf")
        self.held = 0

    def warning(self, message: str, *args) -> bool:
        """Log it now unless one went out less than ``every_s`` ago; returns whether it did."""
        now = self.clock()
        if now < self.next_at:
            self.held += 1
            return False
        if self.held:
            message += f" ({self.held} more like it in the last {self.every_s:g} s)"
        self.log.warning(message, *args)
        self.next_at, self.held = now + self.every_s, 0
        return True


def resume(sources, marker: str, load: Callable[[str], dict], log: logging.Logger,
           files: tuple[str, ...] = ()) -> tuple[str, dict | None]:
    """Load the first of ``sources`` (folders; empty ones skipped) that holds ``marker`` and
    fits: one that does not (another model's shape, another network) is skipped with a warning
    that says why. The first source is the service's own folder: a damaged checkpoint there
    (``load`` raised anything but ``CheckpointMismatch``, ``FileNotFoundError``) has its
    ``files`` moved aside with a warning; a damaged one elsewhere (a ``--warmup`` the user
    owns) is only skipped. Returns (the folder, its meta), or ("", None) for a cold start,
    which is logged too. ``load`` leaves what it loads into unchanged when it raises, or the
    caller makes it afresh."""
    for i, source in enumerate(sources):
        if not source or not (Path(source) / marker).is_file():
            continue
        try:
            meta = load(str(source))
        except (CheckpointMismatch, FileNotFoundError) as exc:
            log.warning("not resuming from %s: %s", source, exc)
            continue
        except Exception as exc:  # any decode error of the bytes on disk: a damaged one
            if i == 0 and files:
                try:
                    done = "moved " + ", ".join(move_aside(Path(source), files)) + \
                        f" aside as *{DAMAGED_SUFFIX}"
                except OSError as move_error:  # a read-only folder: the next save replaces it
                    done = f"not moved aside ({move_error})"
                log.warning("damaged checkpoint in %s (%s: %s): %s", source,
                            type(exc).__name__, exc, done)
            else:
                log.warning("not resuming from %s: damaged (%s: %s)", source,
                            type(exc).__name__, exc)
            continue
        log.info("resumed from %s (%d tokens)", source, meta.get("tokens", 0))
        return str(source), meta
    log.info("no checkpoint that fits: starting cold")
    return "", None
