"""The shared traces the tests marked `traces` need, and slices of a trace by sequence."""

from __future__ import annotations

from pathlib import Path

from common.traces import DEFAULT_TRACES_DIR, Trace

SHARED_TRACES_DIR = DEFAULT_TRACES_DIR
SHARED_FAMILIES = ("gptoss20b", "warp")


def missing_shared_traces(traces_dir: Path | None = None) -> str | None:
    """Why the tests marked `traces` cannot run here (the reason they skip with), or None when
    ``traces_dir`` (SHARED_TRACES_DIR unless given) holds every family they read."""
    traces_dir = SHARED_TRACES_DIR if traces_dir is None else Path(traces_dir)
    absent = [family for family in SHARED_FAMILIES if not (traces_dir / family).is_dir()]
    if not absent:
        return None
    return (f"needs the shared traces: {', '.join(f'{family}/' for family in absent)} not found "
            f"in {traces_dir}")


def sequences_slice(trace: Trace, name: str, first: int, count: int) -> Trace:
    """``count`` whole sequences of ``trace`` from sequence ``first``, as a trace of its own."""
    a, b = int(trace.offsets[first]), int(trace.offsets[first + count])
    return Trace(name, trace.experts[a:b], trace.offsets[first:first + count + 1] - a,
                 trace.num_experts, trace.model, trace.probs[a:b],
                 trace.sequences[first:first + count])
