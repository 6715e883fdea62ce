"""Quantized copies of expert weights: INT8 per output channel, INT4 per group of inputs.

The store writer makes the copies with these functions and the inference worker computes with
them (``services/inference_worker/quantized.py``); ``dequantize`` is the reference both are
checked against, and what `flashmoe precision-report` measures.

Canonical layout: rows are output channels, ``[out, in]``. A weight is given in its model's
layout (``native``): transformers' F.linear-style experts (Qwen3-MoE, OLMoE, Mixtral:
``gate_up_proj[e]`` [2I, H], ``down_proj[e]`` [H, I]) already are ``[out, in]``; GPT-OSS
multiplies ``x @ W`` (``gate_up_proj[e]`` [H, 2I], ``down_proj[e]`` [I, H]), so its native is
``[in, out]`` and the copy is of its transpose (``transposed=True``).

  INT8   scale[o] = max_i |w[o, i]| / 127                       float32 [out]
         q[o, i]  = clamp(round(w[o, i] / scale[o]), -127, 127)  int8 [out, in]
  INT4   the inputs zero-padded to in_pad = ceil(in / G) * G; per group g of G inputs of a row
         scale[o, g] = float16(max |w[o, gG:(g+1)G]| / 7)       float16 [out, in_pad / G]
         q[o, i]     = clamp(round(w[o, i] / scale[o, i // G]), -8, 7)
         packed[o, j] = (q[o, 2j] + 8) | (q[o, 2j + 1] + 8) << 4 uint8 [out, in_pad / 2]

round is half to even. The INT4 scale is computed in float32 and rounded to float16 before
quantizing, so that dequantizing (q * scale) gives exactly the values the copy stands for. A
zero row (INT8) or group (INT4), and a group whose scale rounds to 0 in float16, get scale 1 and
q 0. Biases are not quantized: a copy keeps them in their native dtype.

Functions take a torch tensor (bf16 included) or a numpy array and return torch tensors (CPU,
contiguous); ``.numpy()`` gives the bytes to write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GROUP_SIZE = 32  # INT4: inputs per scale
INT8_MAX = 127
INT4_MIN, INT4_MAX = -8, 7
INT4_OFFSET = 8  # a nibble holds q + 8
PRECISIONS = ("native", "int8", "int4")
QUANTIZED = ("int8", "int4")


@dataclass(frozen=True)
class QuantPart:
    """One tensor of a weight's quantized copy, as the store lays it out."""
    role: str  # "q" (the integers) or "scale"
    dtype: str  # safetensors dtype string: I8, U8, F32, F16
    shape: tuple[int, ...]
    nbytes: int


def canonical_shape(native_shape, transposed: bool) -> tuple[int, int]:
    """(out, in) of a weight of model-layout shape ``native_shape``."""
    if len(native_shape) != 2:
        raise ValueError(f"a quantized weight is a matrix; got shape {tuple(native_shape)}")
    rows, cols = (int(d) for d in native_shape)
    return (cols, rows) if transposed else (rows, cols)


def padded_inputs(inputs: int, group_size: int = GROUP_SIZE) -> int:
    """in_pad: the inputs rounded up to whole groups."""
    _check_group(group_size)
    return math.ceil(inputs / group_size) * group_size


def copy_parts(native_shape, transposed: bool, precision: str,
               group_size: int = GROUP_SIZE) -> list[QuantPart]:
    """The tensors of a weight's copy at ``precision`` (int8 or int4), in their order: the
    integers, then the scales. The writer places each at an aligned offset of its own."""
    out, inputs = canonical_shape(native_shape, transposed)
    if precision == "int8":
        return [QuantPart("q", "I8", (out, inputs), out * inputs),
                QuantPart("scale", "F32", (out,), 4 * out)]
    if precision == "int4":
        in_pad = padded_inputs(inputs, group_size)
        groups = in_pad // group_size
        return [QuantPart("q", "U8", (out, in_pad // 2), out * in_pad // 2),
                QuantPart("scale", "F16", (out, groups), 2 * out * groups)]
    raise ValueError(f"precision must be one of {QUANTIZED}, got {precision!r}")


def copy_nbytes(native_shape, transposed: bool, precision: str,
                group_size: int = GROUP_SIZE) -> int:
    """Bytes of a weight's copy, its tensors back to back (no alignment padding)."""
    return sum(p.nbytes for p in copy_parts(native_shape, transposed, precision, group_size))


def quantize_int8(w, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale float32 [out]) of the native-layout weight ``w``."""
    import torch

    rows = _canonical(w, transposed)
    scale = rows.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(rows / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def quantize_int4(w, transposed: bool, group_size: int = GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [out, in_pad / 2], scale float16 [out, in_pad / group_size]) of the
    native-layout weight ``w``."""
    import torch

    rows = _canonical(w, transposed)
    out, inputs = rows.shape
    in_pad = padded_inputs(inputs, group_size)
    if in_pad != inputs:
        rows = torch.nn.functional.pad(rows, (0, in_pad - inputs))
    groups = rows.view(out, in_pad // group_size, group_size)
    scale = (groups.abs().amax(dim=2) / INT4_MAX).clamp_(max=torch.finfo(torch.float16).max)
    scale16 = scale.to(torch.float16)
    scale16 = torch.where(scale16 > 0, scale16, torch.ones_like(scale16))
    q = torch.round(groups / scale16.float()[:, :, None]).clamp_(INT4_MIN, INT4_MAX)
    nibbles = (q.to(torch.int16) + INT4_OFFSET).to(torch.uint8).view(out, in_pad // 2, 2)
    packed = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
    return packed.contiguous(), scale16.contiguous()


def unpack_int4(packed) -> torch.Tensor:
    """The signed values (int8 [out, in_pad]) of packed INT4 rows."""
    import torch

    packed = torch.as_tensor(packed)
    low = (packed & 0xF).to(torch.int8) - INT4_OFFSET
    high = (packed >> 4).to(torch.int8) - INT4_OFFSET
    return torch.stack((low, high), dim=2).view(packed.shape[0], -1)


def dequantize_int8(q, scale, transposed: bool) -> torch.Tensor:
    """The float32 weight, in the native layout, that an INT8 copy stands for."""
    import torch

    rows = torch.as_tensor(q).float() * torch.as_tensor(scale).float()[:, None]
    return _native(rows, transposed)


def dequantize_int4(packed, scale, native_shape, transposed: bool,
                    group_size: int = GROUP_SIZE) -> torch.Tensor:
    """The float32 weight, in the native layout, that an INT4 copy stands for."""
    import torch

    out, inputs = canonical_shape(native_shape, transposed)
    values = unpack_int4(packed).float().view(out, -1, group_size)
    rows = (values * torch.as_tensor(scale).float()[:, :, None]).view(out, -1)[:, :inputs]
    return _native(rows, transposed)


def dequantize(precision: str, q, scale, native_shape, transposed: bool,
               group_size: int = GROUP_SIZE) -> torch.Tensor:
    """``dequantize_int8`` or ``dequantize_int4`` by ``precision``."""
    if precision == "int8":
        return dequantize_int8(q, scale, transposed)
    if precision == "int4":
        return dequantize_int4(q, scale, native_shape, transposed, group_size)
    raise ValueError(f"precision must be one of {QUANTIZED}, got {precision!r}")


def quantize(precision: str, w, transposed: bool, group_size: int = GROUP_SIZE
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int8`` or ``quantize_int4`` by ``precision``: (q, scale)."""
    if precision == "int8":
        return quantize_int8(w, transposed)
    if precision == "int4":
        return quantize_int4(w, transposed, group_size)
    raise ValueError(f"precision must be one of {QUANTIZED}, got {precision!r}")


def _check_group(group_size: int) -> None:
    if group_size < 2 or group_size % 2:
        raise ValueError(f"the INT4 group size must be even and at least 2, got {group_size}")


def _canonical(w, transposed: bool) -> torch.Tensor:
    """``w`` as float32 [out, in], contiguous (the callers never write to it)."""
    import torch

    w = torch.as_tensor(w)
    canonical_shape(w.shape, transposed)
    if not w.is_floating_point():
        raise TypeError(f"a weight to quantize must be floating point, got {w.dtype}")
    w = w.to(torch.float32)
    return (w.T if transposed else w).contiguous()


def _native(rows: torch.Tensor, transposed: bool) -> torch.Tensor:
    return (rows.T if transposed else rows).contiguous()
