"""Where the benchmark programs put their JSON."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(doc: dict, path: str | Path) -> None:
    """Write a report as indented JSON, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def pyplot():
    """matplotlib's pyplot on the Agg backend (a plot written to a file, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
