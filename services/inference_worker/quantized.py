"""One expert's weight matrix at INT8 or INT4 (``common/quant.py``'s format), computed by
C kernels (``csrc/fm_qgemv.c``) where transformers' eager experts code uses a weight slice.

``QWeight`` stands in for the slice: transformers' eager experts forward calls
``F.linear(x, W)`` on it (Qwen3-MoE, OLMoE, Mixtral: W native [out, in]) or ``x @ W``
(GPT-OSS: W native [in, out], a copy with ``transposed``), and both come here through
``__torch_function__``: y[..., o] = sum_i W[o, i] x[..., i] in the canonical layout, in x's
dtype. The activations are widened to float32 once a call, the weights are read as stored
(from the arena, no copy) and widened in registers: an INT8 copy is half the bytes of bf16,
an INT4 copy (group 32) about 28%, and a decode step's products are bound by those bytes.

The C library is built by ``flashmoe build-helper``; without it (no compiler) the product is
the pure-torch reference (dequantize, then a float32 product: milliseconds a matrix), and
``why_not()`` says why.

Measured here (AMD EPYC with AVX-512, 2 cores shared with another process; one product at
M = 1 through what the worker calls, Python included; median us; hot: one weight again and
again, cold: 40 copies in turn, as an arena's experts are; bf16 and torch's
``_weight_int8pack_mm`` with 1 / 2 torch threads, the C kernels on one thread):

  native shape      bf16 1t/2t     int8 C   int4 C   _weight_int8pack_mm 1t/2t
  [2880, 1210] hot    341 / 286      131      184       172 / 101
               cold   850 / 505      276      199       335 / 175
  [605, 2880]  hot    155 / 108       72      101        93 / 49
               cold   415 / 270      205      105       265 / 188
  [1024, 960]  hot     92 / 65        43       57        52 / 27
               cold   247 / 228      109       61       127 / 70
  [480, 1024]  hot     60 / 38        24       33        27 / 15
               cold   127 / 74        42       33        39 / 28

(gpt-oss at the e2e benchmark's scale, hidden 2880 and intermediate ~605, then the
qwen3-moe-1.7b shape; ``_weight_int8pack_mm`` rounds its scales to bf16.)

The native bf16 weights have a kernel of the library too: ``bf16_products`` multiplies one row
with each of a layer's experts' weights in one ``fm_bf16_gemv`` call (AVX-512 BF16 where the
CPU has it), reading them in place; the trace-driven worker computes through it
(``trace_compute``). A layer's eight cold experts at the qwen3-moe-1.7b shape (gate_up
[1024, 960] and down [480, 1024], 23.6 MB), median, one thread, same conditions as above:
~1.4 ms (~17 GB/s) against ~3.9 ms for torch's bf16 products one expert at a time, in either
layout ([in, out] and [out, in]).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from common.cbuild import build_library, load_library
from common.quant import (GROUP_SIZE, QUANTIZED, canonical_shape, copy_parts, dequantize,
                          padded_inputs, quantize)

CSRC_DIR = Path(__file__).parent / "csrc"
SOURCE = CSRC_DIR / "fm_qgemv.c"
LIBRARY = CSRC_DIR / "libfm_qgemv.so"
ABI_VERSION = 3

_lib: ctypes.CDLL | None = None
_why_not = ""

_TORCH_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "F32": torch.float32,
                 "F16": torch.float16}


def build(force: bool = False) -> Path:
    """Compile the library (``flashmoe build-helper``); raises BuildError. -O3 without
    -march: the AVX-512 kernels are compiled for their own target and chosen at run time, so
    a library built in an image runs on any x86-64."""
    return build_library(SOURCE, LIBRARY, ["-O3"], [], force)


def load() -> ctypes.CDLL | None:
    """The library, or None (``why_not()`` says why): not built, or from another ABI."""
    global _lib, _why_not
    if _lib is not None or _why_not:
        return _lib
    lib, _why_not = load_library(LIBRARY, "fm_qgemv_abi_version", ABI_VERSION)
    if lib is None:
        return None
    ptr, i = ctypes.c_void_p, ctypes.c_int
    lib.fm_q8_gemv.argtypes = [ptr, ptr, ptr, ptr, i, i, i]
    lib.fm_q8_gemv.restype = i
    lib.fm_q4_gemv.argtypes = [ptr, ptr, ptr, ptr, i, i, i, i]
    lib.fm_q4_gemv.restype = i
    lib.fm_q8_gemv_bf16.argtypes = [ptr, ptr, ptr, ptr, i, i, i]
    lib.fm_q8_gemv_bf16.restype = i
    lib.fm_q4_gemv_bf16.argtypes = [ptr, ptr, ptr, ptr, i, i, i, i, i]
    lib.fm_q4_gemv_bf16.restype = i
    lib.fm_qgemv_simd.argtypes = [i]
    lib.fm_qgemv_simd.restype = i
    lib.fm_bf16_gemv.argtypes = [i, ptr, ptr, ptr, i, ptr, i, i, i]
    lib.fm_bf16_gemv.restype = i
    lib.fm_bf16_simd.argtypes = []
    lib.fm_bf16_simd.restype = i
    _lib = lib
    return lib


def why_not() -> str:
    return _why_not


def kernel() -> str:
    """Which product runs: "avx512", "portable" (the C loops) or "torch" (no library)."""
    lib = load()
    if lib is None:
        return "torch"
    return "avx512" if lib.fm_qgemv_simd(-1) else "portable"


def native_kernel() -> str:
    """Which product ``bf16_products`` runs: "avx512_bf16", "portable" (the C loops) or
    "torch" (no library: None)."""
    lib = load()
    if lib is None:
        return "torch"
    return "avx512_bf16" if lib.fm_bf16_simd() else "portable"


def bf16_products(x: torch.Tensor, weights: list[torch.Tensor], biases: list | None,
                  transposed: bool) -> torch.Tensor | None:
    """x_j @ W_j + b_j for each of n native bf16 weights at M = 1, in one ``fm_bf16_gemv``
    call that reads the weights in place: ``x`` [1, in] (the same row for every weight) or
    [n, in]; ``weights`` of one native shape, [in, out] when ``transposed`` (GPT-OSS's x @ W)
    else [out, in] (F.linear's), contiguous; ``biases`` [out] each, or None. Returns [n, out]
    bf16: torch's bf16 product and bias add but for the order of the float32 sums (the two
    agree to a bf16 rounding); None without the library (the caller multiplies in torch)."""
    lib = load()
    if lib is None:
        return None
    n, bf16 = len(weights), torch.bfloat16
    shape = weights[0].shape
    inputs, out = (shape[0], shape[1]) if transposed else (shape[1], shape[0])
    bias_shape = (out,)
    # The kernel reads these bytes as they are: every tensor is checked (~0.3 us each).
    if not all(w.dtype is bf16 and w.shape == shape and w.is_contiguous() and w.is_cpu
               for w in weights) or biases is not None and not all(
            b.dtype is bf16 and b.shape == bias_shape and b.is_contiguous() and b.is_cpu
            for b in biases) or x.dtype is not bf16 or x.dim() != 2 \
            or x.shape[0] not in (1, n) or x.shape[1] != inputs:
        raise ValueError(f"bf16_products takes contiguous CPU bf16 weights of one shape "
                         f"{tuple(shape)}, biases ({out},) and x [1 or {n}, {inputs}]; got "
                         f"{[(w.dtype, tuple(w.shape)) for w in weights]}, "
                         f"{biases and [(b.dtype, tuple(b.shape)) for b in biases]} and "
                         f"{x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    y = torch.empty(n, out, dtype=bf16)
    rc = lib.fm_bf16_gemv(n, (ctypes.c_void_p * n)(*[w.data_ptr() for w in weights]),
                          None if biases is None else
                          (ctypes.c_void_p * n)(*[b.data_ptr() for b in biases]),
                          x.data_ptr(), inputs if x.shape[0] > 1 else 0, y.data_ptr(), out,
                          inputs, int(transposed))
    if rc != 0:
        raise RuntimeError(f"fm_bf16_gemv failed ({rc}) on {n} weights {tuple(shape)}")
    return y


class QWeight:
    """One expert's weight matrix as a quantized copy: ``q`` and ``scale`` as
    ``common.quant`` lays them out (canonical [out, in] rows; views of the arena, never
    written), ``native_shape`` the model's shape of the weight it stands for.

    Works where transformers' eager experts code uses the native weight slice:
    ``F.linear(x, W[, b])`` when the native layout is [out, in] (``transposed`` False) and
    ``x @ W`` / ``torch.matmul(x, W)`` when it is [in, out] (``transposed`` True); ``.T``
    gives the same copy seen in the other layout. ``dtype`` is the compute dtype (the
    model's), as the eager code would see on a slice of its parameters."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, precision: str, native_shape,
                 transposed: bool, group_size: int = GROUP_SIZE,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        native_shape = tuple(int(d) for d in native_shape)
        transposed = bool(transposed)
        for tensor, (role, shape, tensor_dtype) in zip((q, scale), _expected(
                native_shape, transposed, precision, group_size)):
            if (tensor.shape != shape or tensor.dtype != tensor_dtype
                    or not tensor.is_contiguous() or tensor.device.type != "cpu"):
                raise ValueError(f"{precision} {role} of a {native_shape} weight must be a "
                                 f"contiguous CPU {tensor_dtype} tensor {tuple(shape)}; got "
                                 f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
        self.q, self.scale = q, scale
        self._pointers = (q.data_ptr(), scale.data_ptr())  # the kernels' arguments, once
        self.precision = precision
        self.native_shape = native_shape
        self.transposed = transposed
        self.group_size = group_size
        self.dtype = dtype
        self.out_features, self.in_features = canonical_shape(native_shape, transposed)

    @classmethod
    def quantize(cls, w: torch.Tensor, precision: str, transposed: bool,
                 group_size: int = GROUP_SIZE) -> QWeight:
        """A copy of the native-layout weight ``w`` (tests, the precision report)."""
        q, scale = quantize(precision, w, transposed, group_size)
        return cls(q, scale, precision, tuple(w.shape), transposed, group_size, w.dtype)

    # --- what a weight slice shows ----------------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.native_shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def ndim(self) -> int:
        return 2

    def dim(self) -> int:
        return 2

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def T(self) -> QWeight:  # noqa: N802 (torch's name)
        return QWeight(self.q, self.scale, self.precision, self.native_shape[::-1],
                       not self.transposed, self.group_size, self.dtype)

    def t(self) -> QWeight:
        return self.T

    def __repr__(self) -> str:
        return (f"QWeight({self.precision}, native_shape={self.native_shape}, "
                f"transposed={self.transposed}, group_size={self.group_size})")

    # --- the products -----------------------------------------------------------------------

    def dequantize(self) -> torch.Tensor:
        """The float32 weight in the native layout (the reference)."""
        return dequantize(self.precision, self.q, self.scale, self.native_shape,
                          self.transposed, self.group_size)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """y[..., o] = sum_i W[o, i] x[..., i] (canonical layout), in x's dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self!r}: input of {x.shape[-1]} features, the weight takes "
                             f"{self.in_features}")
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        lib = load()
        if lib is None:
            y = (rows.float() @ _canonical(self.dequantize(), self.transposed).T).to(x.dtype)
        elif x.dtype == torch.bfloat16:
            y = self._kernel_bf16(lib, rows.contiguous())
        else:
            y = self._kernel(lib, rows).to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def _kernel(self, lib: ctypes.CDLL, rows: torch.Tensor) -> torch.Tensor:
        """The float32 product of rows of any dtype, widened here."""
        M = rows.shape[0]
        y = torch.empty(M, self.out_features, dtype=torch.float32)
        if M == 0:
            return y
        q, scale = self._pointers
        if self.precision == "int8":
            xf = rows.to(torch.float32).contiguous()
            rc = lib.fm_q8_gemv(q, scale, xf.data_ptr(), y.data_ptr(), M, self.out_features,
                                self.in_features)
        else:
            in_pad = padded_inputs(self.in_features, self.group_size)
            if in_pad == self.in_features:
                xf = rows.to(torch.float32).contiguous()
            else:
                xf = torch.zeros(M, in_pad, dtype=torch.float32)
                xf[:, :self.in_features] = rows
            rc = lib.fm_q4_gemv(q, scale, xf.data_ptr(), y.data_ptr(), M, self.out_features,
                                in_pad, self.group_size)
        if rc != 0:
            raise RuntimeError(f"{self!r}: the {self.precision} kernel failed ({rc})")
        return y

    def _kernel_bf16(self, lib: ctypes.CDLL, rows: torch.Tensor) -> torch.Tensor:
        """The product of bf16 rows (the worker's), widened and rounded back in C: the same
        values as ``_kernel``'s product rounded by torch, two tensor conversions fewer."""
        M = rows.shape[0]
        y = torch.empty(M, self.out_features, dtype=torch.bfloat16)
        if M == 0:
            return y
        q, scale = self._pointers
        if self.precision == "int8":
            rc = lib.fm_q8_gemv_bf16(q, scale, rows.data_ptr(), y.data_ptr(), M,
                                     self.out_features, self.in_features)
        else:
            rc = lib.fm_q4_gemv_bf16(q, scale, rows.data_ptr(), y.data_ptr(), M,
                                     self.out_features, self.in_features,
                                     padded_inputs(self.in_features, self.group_size),
                                     self.group_size)
        if rc != 0:
            raise RuntimeError(f"{self!r}: the {self.precision} kernel failed ({rc})")
        return y

    # --- torch dispatch ---------------------------------------------------------------------

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, weight = _arguments(args, kwargs, ("input", "weight"))
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(weight, QWeight) and not isinstance(x, QWeight) \
                    and not weight.transposed:
                y = weight.product(x)
                return y if bias is None else y + bias
        elif func in _MATMULS:
            x, weight = _arguments(args, kwargs, ("input", "other"))
            if isinstance(weight, QWeight) and not isinstance(x, QWeight) \
                    and weight.transposed:
                return weight.product(x)
        raise TypeError(f"QWeight computes F.linear(x, W) with W native [out, in] and x @ W "
                        f"with W native [in, out]; not {getattr(func, '__name__', func)} on "
                        f"{[type(a).__name__ for a in args]}")


_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


@functools.lru_cache(maxsize=256)
def _expected(native_shape: tuple[int, ...], transposed: bool, precision: str,
              group_size: int) -> tuple[tuple[str, torch.Size, torch.dtype], ...]:
    """(role, shape, dtype) of a copy's tensors: a worker makes QWeights of a few shapes for
    every expert it fetches, so the checks are worked out once per shape."""
    if precision not in QUANTIZED:
        raise ValueError(f"precision must be one of {QUANTIZED}, got {precision!r}")
    return tuple((p.role, torch.Size(p.shape), _TORCH_DTYPES[p.dtype])
                 for p in copy_parts(native_shape, transposed, precision, group_size))


def _arguments(args, kwargs, names) -> list:
    return [args[k] if k < len(args) else kwargs[name] for k, name in enumerate(names)]


def _canonical(native: torch.Tensor, transposed: bool) -> torch.Tensor:
    return native.T if transposed else native


class ExpertSlices:
    """Stands in for one fused parameter ([E, ...]) of an experts module: ``[e]`` is expert
    e's slice (a ``QWeight`` for a weight matrix), as the eager code indexes it."""

    def __init__(self, slices: list) -> None:
        self.slices = slices

    def __getitem__(self, expert):
        return self.slices[int(expert)]

    def __len__(self) -> int:
        return len(self.slices)


def quantize_experts_module(experts: torch.nn.Module, precision: str,
                            group_size: int = GROUP_SIZE) -> None:
    """Replace, in place, each fused parameter of a transformers experts module by per-expert
    slices: every weight matrix a ``QWeight`` at ``precision``, every bias as it was (what
    the worker's fetch hands the eager code for an expert held as a copy). Which layout a
    family's matrices have is transformers' own flag, ``experts.is_transposed`` (True: GPT-OSS's
    ``x @ W``)."""
    if not hasattr(experts, "is_transposed"):
        raise TypeError(f"{type(experts).__name__} has no is_transposed: not a transformers 5 "
                        f"experts module (use_experts_implementation)")
    transposed = bool(experts.is_transposed)
    for name, parameter in list(experts.named_parameters(recurse=False)):
        data = parameter.detach()
        slices = [QWeight.quantize(data[e], precision, transposed, group_size)
                  if data.dim() == 3 else data[e] for e in range(data.shape[0])]
        delattr(experts, name)
        object.__setattr__(experts, name, ExpertSlices(slices))
