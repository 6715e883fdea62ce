"""Expert-routing traces: the shared real traces and FlashMoE's own recorded format.

A ``Trace`` is the router's choice per decode token and MoE layer: ``experts`` of shape
(tokens, layers, top_k), sequences delimited by ``offsets`` (sequence i is rows
``offsets[i]:offsets[i+1]``), optionally the router ``probs`` of the same shape.

The full traces live outside the project, in a folder found by ``find_traces_dir``: the
``--traces-dir`` flag, else the ``traces.dir`` setting, else ``../shared/traces`` beside the
checkout. They are never copied into the project:
  - ``gptoss20b[:split]``: openai/gpt-oss-20b; split ``train``, ``eval``, ``all``, or ``fit``
    and ``dev`` (train without / only ``gpqa_main``: warm up on fit, make choices on dev);
    sequences with ``has_repetition`` are always dropped (the traces' rule for reported numbers).
  - ``warp:olmoe``, ``warp:kimi``: the two small warp traces (one sequence each).

The committed sample (``common/data/gptoss20b-sample/``, with the dataset's LICENSE and
provenance) is a trace of its own name, so that it is never mistaken for a full split:
  - ``gptoss20b-sample:train``: the whole train sequences of the first ``SAMPLE_TRAIN_TOKENS``
    tokens (what ``flashmoe run`` warms up on);
  - ``gptoss20b-sample:eval``: the first eval sequences holding ``SAMPLE_EVAL_TOKENS`` tokens.

FlashMoE trace file format (``*.npz``, written by ``flashmoe trace record``; version 1):
  - ``experts``: int16 (tokens, layers, top_k), expert ids in the router's top-k order;
  - ``offsets``: int64 (sequences + 1,), ``offsets[0] == 0``, ``offsets[-1] == tokens``;
  - ``probs``: float16 (tokens, layers, top_k), optional, router probabilities of those experts;
  - ``meta``: a 0-d unicode array holding JSON: ``{"format": "flashmoe-trace", "version": 1,
    "model": <model name or path>, "model_type": ..., "num_experts": E, "moe_layers": [...],
    "sequences": [{...per-sequence info, e.g. prompt_tokens...}]}``.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

TRACE_FORMAT = "flashmoe-trace"
TRACE_VERSION = 1
MAX_EXPERTS = np.iinfo(np.int16).max  # expert ids are stored as int16
# What reading a damaged .npz or JSON file raises, besides the errors said in words below
# (zipfile raises NotImplementedError for a version or compression method it does not know,
# zlib.error for a damaged compressed member).
UNREADABLE = (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile, RecursionError,
              NotImplementedError, zlib.error)
DEFAULT_TRACES_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
SAMPLE_DIR = Path(__file__).resolve().parent / "data" / "gptoss20b-sample"
SAMPLE_NAME = "gptoss20b-sample"
SAMPLE_TRAIN_TOKENS = 12_000
SAMPLE_EVAL_TOKENS = 600

GPTOSS_TRAIN = ("mmlu_dev", "mmlu_validation", "gpqa_main", "sorry_bench_base")
GPTOSS_EVAL = ("mmlu_test", "mmlu_pro_test", "mmlu_pro_validation", "gpqa_diamond",
               "gpqa_extended", "Polyglot-or-Not_Fact-Completion", "tulu3_persona_if")
GPTOSS_DEV = ("gpqa_main",)  # part of train set aside for choices (after warm-up on fit)
SPLITS = {"train": GPTOSS_TRAIN, "eval": GPTOSS_EVAL, "all": GPTOSS_TRAIN + GPTOSS_EVAL,
          "dev": GPTOSS_DEV, "fit": tuple(d for d in GPTOSS_TRAIN if d not in GPTOSS_DEV)}
WARP_FILES = {"olmoe": ("trace_olmoe_299.jsonl", 64, "olmoe-1b-7b"),
              "kimi": ("trace_kimi_300.jsonl", 256, "kimi-linear-48b-a3b")}


class TraceError(ValueError):
    """A trace is missing, malformed, or named wrongly."""


@dataclass
class Trace:
    name: str
    experts: np.ndarray  # (tokens, layers, top_k) int16
    offsets: np.ndarray  # (sequences + 1,) int64
    num_experts: int
    model: str  # model-shape profile name or model path
    probs: np.ndarray | None = None
    sequences: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.experts, np.ndarray) or self.experts.ndim != 3 or \
                not np.issubdtype(self.experts.dtype, np.integer):
            raise TraceError(f"{self.name}: experts must be integers (tokens, layers, top_k)")
        if not isinstance(self.offsets, np.ndarray) or self.offsets.ndim != 1 or \
                not len(self.offsets) or not np.issubdtype(self.offsets.dtype, np.integer):
            raise TraceError(f"{self.name}: offsets must be a list of integers")
        if (self.offsets[0] != 0 or self.offsets[-1] != len(self.experts)
                or np.any(np.diff(self.offsets) < 0)):
            raise TraceError(f"{self.name}: offsets do not delimit the tokens")
        if type(self.num_experts) is not int or not 1 <= self.num_experts <= MAX_EXPERTS:
            raise TraceError(f"{self.name}: num_experts {self.num_experts!r} is not in "
                             f"[1, {MAX_EXPERTS}]")
        if self.experts.size and (self.experts.min() < 0 or self.experts.max() >= self.num_experts):
            raise TraceError(f"{self.name}: expert ids outside [0, {self.num_experts})")
        if self.probs is not None and (not isinstance(self.probs, np.ndarray)
                                       or self.probs.shape != self.experts.shape
                                       or not np.issubdtype(self.probs.dtype, np.floating)):
            raise TraceError(f"{self.name}: probs must be floats shaped as the experts "
                             f"{self.experts.shape}")
        if not isinstance(self.sequences, list) or not all(
                isinstance(row, dict) and isinstance(row.get("generated_only", []), list)
                for row in self.sequences):
            raise TraceError(f"{self.name}: sequences must be a list of objects (with a list "
                             f"generated_only where there is one)")

    @property
    def n_tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def num_layers(self) -> int:
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        return self.experts.shape[2]

    @property
    def n_sequences(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_requests(self) -> int:
        return self.experts.size


def find_traces_dir(flag: str | Path | None = None, setting: str | Path | None = None) -> Path:
    """The folder of the full traces: ``--traces-dir``, else the ``traces.dir`` setting, else
    ``../shared/traces`` beside the checkout (which need not exist: loading then says so)."""
    for choice in (flag, setting):
        if choice:
            return Path(choice).expanduser()
    return DEFAULT_TRACES_DIR


def has_full_traces(traces_dir: str | Path | None = None) -> bool:
    """Whether the full gpt-oss-20b traces are in ``traces_dir`` (default: as found)."""
    return (find_traces_dir(traces_dir) / "gptoss20b" / "routing.npz").is_file()


def first_sequences(trace: Trace, tokens: int, cover: bool = False) -> Trace:
    """The first whole sequences of ``trace``: those that fit in ``tokens`` tokens (at least
    one), or with ``cover`` the fewest that hold at least ``tokens``."""
    side = "left" if cover else "right"
    count = int(np.searchsorted(trace.offsets, tokens, side=side)) - (0 if cover else 1)
    count = min(max(1, count), trace.n_sequences)
    end = int(trace.offsets[count])
    return Trace(f"{trace.name}[:{end}]", trace.experts[:end], trace.offsets[:count + 1],
                 trace.num_experts, trace.model,
                 trace.probs[:end] if trace.probs is not None else None,
                 trace.sequences[:count])


def _select_sequences(experts: np.ndarray, offsets: np.ndarray, keep: np.ndarray,
                      probs: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    lengths = np.diff(offsets)[keep]
    rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in np.flatnonzero(keep)])
    new_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return experts[rows], new_offsets, (probs[rows] if probs is not None else None)


def load_gptoss20b(split: str = "eval", traces_dir: str | Path | None = None) -> Trace:
    folder = find_traces_dir(traces_dir) / "gptoss20b"
    if split not in SPLITS:
        raise TraceError(f"gptoss20b split {split!r}: choose {', '.join(SPLITS)}")
    if not has_full_traces(traces_dir):
        raise TraceError(f"{folder}: the full gpt-oss-20b traces are not there (routing.npz and "
                         f"meta.jsonl): give their folder with --traces-dir or the traces.dir "
                         f"setting; the committed sample is the trace "
                         f"{SAMPLE_NAME}:train|eval")
    try:
        with np.load(folder / "routing.npz", allow_pickle=False) as z:
            experts, probs, offsets = z["experts"], z["probs"], z["offsets"]
        meta = [json.loads(line) for line in (folder / "meta.jsonl").read_text().splitlines()
                if line]
    except UNREADABLE as exc:
        raise TraceError(f"{folder}: the gpt-oss-20b trace cannot be read: {exc}") from None
    Trace(folder.name, _ids(experts, folder), _offsets(offsets, folder), 32, "gpt-oss-20b",
          probs)  # checks the arrays before they are cut
    if len(meta) != len(offsets) - 1:
        raise TraceError(f"{folder}: {len(meta)} meta rows for {len(offsets) - 1} sequences")
    keys = ("dataset", "category", "n_decode_tokens", "first_token_pos", "generated_only")
    if not all(isinstance(m, dict) and "has_repetition" in m and all(k in m for k in keys)
               and isinstance(m["dataset"], str) for m in meta):
        raise TraceError(f"{folder}: meta.jsonl rows must be objects with has_repetition and "
                         f"{', '.join(keys)}")
    datasets = SPLITS[split]
    keep = np.array([not m["has_repetition"] and m["dataset"] in datasets for m in meta],
                    dtype=bool)
    unknown = {m["dataset"] for m in meta} - set(GPTOSS_TRAIN + GPTOSS_EVAL)
    if unknown:
        raise TraceError(f"{folder}: datasets in no split: {sorted(unknown)}")
    if not keep.any():
        raise TraceError(f"{folder}: no sequence of the split {split!r}")
    experts, offsets, probs = _select_sequences(experts, offsets, keep, probs)
    sequences = [{k: m[k] for k in keys} for m, k_ in zip(meta, keep) if k_]
    return Trace(f"gptoss20b:{split}", experts.astype(np.int16), offsets, 32, "gpt-oss-20b",
                 probs, sequences)


def _ids(values: Any, where: Any) -> np.ndarray:
    """Expert ids as int16, refused (not wrapped) when they are not integers that fit."""
    array = np.asarray(values)
    if not np.issubdtype(array.dtype, np.integer) or array.ndim != 3:
        raise TraceError(f"{where}: experts must be integers (tokens, layers, top_k), found "
                         f"{array.dtype} of shape {array.shape}")
    if array.size and (array.min() < 0 or array.max() > MAX_EXPERTS):
        raise TraceError(f"{where}: expert ids outside [0, {MAX_EXPERTS}]")
    return array.astype(np.int16)


def _offsets(values: Any, where: Any) -> np.ndarray:
    array = np.asarray(values)
    if not np.issubdtype(array.dtype, np.integer) or array.ndim != 1:
        raise TraceError(f"{where}: offsets must be a list of integers, found {array.dtype} of "
                         f"shape {array.shape}")
    return array.astype(np.int64)


def load_sample(split: str) -> Trace:
    """``gptoss20b-sample:train|eval``, the small sample committed in the project."""
    path = SAMPLE_DIR / f"{split}.npz"
    if split not in ("train", "eval"):
        raise TraceError(f"{SAMPLE_NAME} split {split!r}: choose train, eval")
    if not path.is_file():
        raise TraceError(f"{path}: the committed sample trace is missing")
    trace = load_trace_file(path)
    trace.name = f"{SAMPLE_NAME}:{split}"
    return trace


def load_warp(which: str, traces_dir: str | Path | None = None) -> Trace:
    if which not in WARP_FILES:
        raise TraceError(f"warp trace {which!r}: choose {', '.join(WARP_FILES)}")
    filename, num_experts, model = WARP_FILES[which]
    path = find_traces_dir(traces_dir) / "warp" / filename
    if not path.is_file():
        raise TraceError(f"{path}: warp trace not found: give the traces' folder with "
                         f"--traces-dir or the traces.dir setting")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line)["layers"])
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise TraceError(f"{path}:{n}: malformed row: {exc}") from None
    try:
        array = np.asarray(rows)
    except (ValueError, TypeError, OverflowError) as exc:  # ragged or mixed rows
        raise TraceError(f"{path}: rows of different shapes or types: {exc}") from None
    experts = _ids(array, path)
    return Trace(f"warp:{which}", experts, np.array([0, len(experts)], dtype=np.int64),
                 num_experts, model)


def save_trace(trace: Trace, path: str | Path, model_type: str = "",
               moe_layers: list[int] | None = None) -> None:
    meta = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "model": trace.model,
            "model_type": model_type, "num_experts": trace.num_experts,
            "moe_layers": moe_layers if moe_layers is not None else list(range(trace.num_layers)),
            "sequences": trace.sequences}
    arrays = {"experts": trace.experts.astype(np.int16), "offsets": trace.offsets.astype(np.int64),
              "meta": np.array(json.dumps(meta))}
    if trace.probs is not None:
        arrays["probs"] = trace.probs.astype(np.float16)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)


def load_trace_file(path: str | Path) -> Trace:
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            experts, offsets = z["experts"], z["offsets"]
            probs = z["probs"] if "probs" in z.files else None
    except UNREADABLE as exc:
        raise TraceError(f"{path}: not a FlashMoE trace file: {exc}") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{path}: not a FlashMoE trace file: its meta is not an object")
    if meta.get("format") != TRACE_FORMAT or meta.get("version") != TRACE_VERSION:
        raise TraceError(f"{path}: format {meta.get('format')!r} version {meta.get('version')!r}"
                         f", expected {TRACE_FORMAT!r} version {TRACE_VERSION}")
    num_experts = meta.get("num_experts")
    if type(num_experts) is not int:
        raise TraceError(f"{path}: meta num_experts must be an integer, found {num_experts!r}")
    sequences = meta.get("sequences", [])
    return Trace(path.name, _ids(experts, path), _offsets(offsets, path), num_experts,
                 str(meta.get("model", "")), probs,
                 list(sequences) if isinstance(sequences, list) else sequences)


def load_trace(spec: str, traces_dir: str | Path | None = None) -> Trace:
    """``gptoss20b:eval``, ``gptoss20b:train``, ..., ``gptoss20b-sample:train|eval``,
    ``warp:olmoe``, ``warp:kimi``, or a file path; ``traces_dir`` as ``find_traces_dir``."""
    source, _, variant = spec.partition(":")
    if source == "gptoss20b":
        return load_gptoss20b(variant or "eval", traces_dir)
    if source == SAMPLE_NAME:
        return load_sample(variant or "eval")
    if source == "warp":
        return load_warp(variant, traces_dir)
    if Path(spec).is_file():
        return load_trace_file(spec)
    raise TraceError(f"unknown trace {spec!r}: use gptoss20b:train|eval|all|fit|dev, "
                     f"{SAMPLE_NAME}:train|eval, warp:olmoe|kimi, "
                     f"or the path of a FlashMoE trace file")


UNKNOWN_TOKEN = "<unk>"  # a step whose token's text the trace does not hold


@dataclass
class TokenStream:
    """Per decode step of a trace: what a worker's AccessEvent carries. A trace without the
    tokens' text (warp's) carries ``UNKNOWN_TOKEN`` for them: "" says that a sequence ended,
    and the feature extractor makes no features for the step after it."""
    sequence: np.ndarray  # (T,) sequence index
    position: np.ndarray  # (T,) step within the sequence
    input_token: list[str]
    next_token: list[str]  # "" at a sequence's end (no step follows)

    @classmethod
    def of(cls, trace: Trace) -> "TokenStream":
        T = trace.n_tokens
        lengths = np.diff(trace.offsets)
        sequence = np.repeat(np.arange(trace.n_sequences), lengths)
        position = np.arange(T) - np.repeat(trace.offsets[:-1], lengths)
        inputs, nexts = [], []
        for i, n in enumerate(lengths.tolist()):
            words = list(trace.sequences[i].get("generated_only", [])) \
                if i < len(trace.sequences) else []
            words = [str(w) for w in words] + [UNKNOWN_TOKEN] * max(0, n + 1 - len(words))
            inputs += words[:n]
            nexts += words[1:n] + [""]
        return cls(sequence, position, inputs, nexts)
