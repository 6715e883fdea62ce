"""Compiling the project's small C libraries with the system compiler, on the machine that
runs them (`flashmoe build-helper`; the set-up script and the image build call it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


class BuildError(RuntimeError):
    pass


def build_library(source: Path, library: Path, flags: list[str] | None = None,
                  libs: list[str] | None = None, force: bool = False) -> Path:
    """``cc -shared`` of ``source`` into ``library``, unless the library is newer than its
    source (or ``force``); raises BuildError with the compiler's message."""
    if library.exists() and not force and library.stat().st_mtime >= source.stat().st_mtime:
        return library
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise BuildError(f"no C compiler found to build {library.name} (set CC)")
    # A name of our own, so that two builds at once each replace the library whole.
    tmp = library.with_suffix(f".so.{os.getpid()}.tmp")
    cmd = [compiler, *(flags or ["-O2"]), "-Wall", "-Wextra", "-shared", "-fPIC", "-o",
           str(tmp), str(source), *(libs or [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"building {library.name} failed ({' '.join(cmd)}):\n"
                         f"{proc.stderr.strip()}")
    os.replace(tmp, library)
    return library


def load_library(library: Path, abi_symbol: str, abi_version: int):
    """(the loaded library, "") or (None, why not): not built, not loadable, or built from
    another ABI (``abi_symbol()`` answers its version)."""
    import ctypes

    if not library.exists():
        return None, f"{library.name} not built (run `flashmoe build-helper`)"
    try:
        lib = ctypes.CDLL(str(library))
    except OSError as exc:
        return None, f"{library.name} does not load: {exc}"
    if getattr(lib, abi_symbol)() != abi_version:
        return None, (f"{library.name} is stale (ABI mismatch; run `flashmoe build-helper "
                      f"--force`)")
    return lib, ""
