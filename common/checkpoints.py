"""Learned state on disk: durable replacement of a file, and resuming a service from the first
of its checkpoint folders that fits.

A checkpoint file is written under a temporary name, synced, renamed over the old one and its
folder synced: a kill or a power cut leaves the last whole file, never a torn one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable


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


def write_text_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    replace_durably(tmp, path)


def resume(sources, marker: str, load: Callable[[str], dict],
           log: logging.Logger) -> tuple[str, dict | None]:
    """Load the first of ``sources`` (folders; empty ones skipped) that holds ``marker`` and
    fits: one that does not (another model's shape, another network, damaged) is skipped with
    a warning that says why. Returns (the folder, its meta), or ("", None) for a cold start,
    which is logged too. ``load`` raises ValueError, KeyError or OSError for a misfit, and
    leaves what it loads into unchanged then or the caller makes it afresh."""
    for source in sources:
        if not source or not (Path(source) / marker).is_file():
            continue
        try:
            meta = load(str(source))
        except (ValueError, KeyError, OSError) as exc:
            log.warning("not resuming from %s: %s", source, exc)
            continue
        log.info("resumed from %s (%d tokens)", source, meta.get("tokens", 0))
        return str(source), meta
    log.info("no checkpoint that fits: starting cold")
    return "", None
