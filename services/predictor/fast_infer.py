"""The predictor's fused one-token inference in C (``csrc/fm_infer.c``), with the per-layer
heads read as float32, bfloat16, or int8 with one scale per output (weight-only quantization:
the inputs stay float32).

Why: a live predictor handles one token and then sleeps until the next, so every token it
starts with cold caches, and its inference time is then mostly the fetching of the heads
(7.9 MB in float32 for gpt-oss-20b's 24 x 32 experts) and a dozen numpy and torch dispatches.
One C call over int8 heads (the default) reads a quarter of the bytes (bf16: half) and
dispatches once.
The numpy path (``Net.step`` and ``estimates``) stays the reference and the fallback when the
library is not built (no compiler): the stats say which one runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch

from common.cbuild import build_library, load_library

from .model import BUCKETS, HEADS, INV, INV_SHIFTED, INV_SHIFTED2, VARIANTS

CSRC_DIR = Path(__file__).parent / "csrc"
SOURCE = CSRC_DIR / "fm_infer.c"
LIBRARY = CSRC_DIR / "libfm_infer.so"
ABI_VERSION = 4
PRECISIONS = ("fp32", "bf16", "int8")  # the C code's FM_FP32, FM_BF16, FM_INT8

_lib: ctypes.CDLL | None = None
_why_not = ""


def build(force: bool = False) -> Path:
    """Compile the library (``flashmoe build-helper``); raises BuildError."""
    return build_library(SOURCE, LIBRARY, ["-O3"], [], force)


def load() -> ctypes.CDLL | None:
    """The library, or None (``why_not()`` says why): not built, or from another ABI."""
    global _lib, _why_not
    if _lib is not None or _why_not:
        return _lib
    lib, _why_not = load_library(LIBRARY, "fm_infer_abi_version", ABI_VERSION)
    if lib is None:
        return None
    ptr, i = ctypes.c_void_p, ctypes.c_int
    lib.fm_infer.argtypes = [i, i, i, i, i, i] + [ptr] * 12
    lib.fm_infer.restype = i
    _lib = lib
    return lib


def why_not() -> str:
    return _why_not


class FusedInference:
    """The C call for one network: its heads in ``precision`` (a copy, made again by
    ``refresh()`` after every training step), its skip weights and bias as views."""

    def __init__(self, net, precision: str = "int8") -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"inference precision must be one of {PRECISIONS}, got "
                             f"{precision!r}")
        self.lib = load()
        if self.lib is None:
            raise RuntimeError(why_not())
        self.net, self.precision = net, precision
        self.L, self.E = net.L, net.E
        self.D = net.head.shape[1]
        self.inv = np.ascontiguousarray(INV, np.float32)
        self.inv_shifted = np.concatenate([[0.0], INV_SHIFTED]).astype(np.float32)
        self.inv_shifted2 = np.concatenate([[0.0, 0.0], INV_SHIFTED2]).astype(np.float32)
        self.work = np.empty(2 * HEADS * BUCKETS * self.E, np.float32)
        self.skip = net.skip.detach().numpy()  # views: training updates them in place
        self.bias = net.bias.detach().numpy()
        self.refresh()

    def refresh(self) -> None:
        """The heads' copy in this precision, from the network's weights now."""
        head = self.net.head.detach()
        self.scale = None
        if self.precision == "bf16":  # round to nearest even, as torch converts
            self.head = head.to(torch.bfloat16).view(torch.int16).numpy().copy()
        elif self.precision == "int8":  # symmetric, one scale per output over the D inputs
            w = head.numpy()
            scale = np.abs(w).max(1) / 127.0  # (L, O)
            scale[scale == 0] = 1.0
            self.head = np.rint(w / scale[:, None, :]).astype(np.int8)
            self.scale = scale.astype(np.float32)
        else:
            self.head = head.numpy()  # a view: training updates it in place

    def __call__(self, h: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """h (L, D) float32 (the layer vectors, or the LSTM's output), x (N, F) float32 ->
        S (VARIANTS, N), p_used (N,): the estimates and the chance each key is used next
        token."""
        h = np.ascontiguousarray(h, np.float32)
        x = np.ascontiguousarray(x, np.float32)
        N, F = x.shape
        S = np.empty((VARIANTS, N), np.float32)
        p_used = np.empty(N, np.float32)
        p = ctypes.c_void_p
        rc = self.lib.fm_infer(self.L, self.E, self.D, F, BUCKETS,
                               PRECISIONS.index(self.precision), p(h.ctypes.data),
                               p(x.ctypes.data), p(self.skip.ctypes.data),
                               p(self.bias.ctypes.data), p(self.head.ctypes.data),
                               p(self.scale.ctypes.data if self.scale is not None else None),
                               p(self.inv.ctypes.data), p(self.inv_shifted.ctypes.data),
                               p(self.inv_shifted2.ctypes.data), p(self.work.ctypes.data),
                               p(p_used.ctypes.data),
                               p(S.ctypes.data))
        if rc != 0:
            raise ValueError(f"fm_infer refused {BUCKETS} buckets at {self.precision}")
        return S, p_used
