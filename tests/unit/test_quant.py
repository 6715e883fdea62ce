"""INT8/INT4 expert copies: the format (common/quant.py), the worker's QWeight and its C
kernels (services/inference_worker/quantized.py, csrc/fm_qgemv.c) against the dequantize
reference, and transformers' eager experts code of every family computing on QWeights."""

import copy

import pytest
import torch

from common import quant
from common.model_families import FAMILIES
from services.inference_worker import quantized
from services.inference_worker.quantized import QWeight, quantize_experts_module

KERNELS = ("avx512", "portable", "torch")


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Run QWeight's products with each kernel in turn; a C kernel the library or the CPU
    does not have skips with the reason."""
    if request.param == "torch":
        monkeypatch.setattr(quantized, "load", lambda: None)
        yield request.param
        return
    lib = quantized.load()
    if lib is None:
        pytest.skip(f"the C kernels: {quantized.why_not()}")
    simd = lib.fm_qgemv_simd(-1)
    got = lib.fm_qgemv_simd(1 if request.param == "avx512" else 0)
    try:
        if request.param == "avx512" and not got:
            pytest.skip("this CPU has no AVX-512 (F, BW, VL)")
        assert quantized.kernel() == request.param
        yield request.param
    finally:
        lib.fm_qgemv_simd(simd)


def _weight(shape, seed=0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


# --- the format ---------------------------------------------------------------------------------

def test_int8_is_symmetric_per_output_channel():
    w = _weight((5, 40), dtype=torch.float32)
    w[3] = 0.0  # a zero row
    q, scale = quant.quantize_int8(w, transposed=False)
    assert q.dtype == torch.int8 and q.shape == (5, 40)
    assert scale.dtype == torch.float32 and scale.shape == (5,)
    assert torch.equal(scale[[0, 1, 2, 4]], w[[0, 1, 2, 4]].abs().amax(1) / 127)
    assert torch.all(q[3] == 0) and int(q.abs().max()) == 127
    assert torch.equal(q, torch.round(w / scale[:, None]).to(torch.int8))
    back = quant.dequantize_int8(q, scale, transposed=False)
    assert torch.all((back - w).abs() <= scale[:, None] / 2 + 1e-9)


def test_transposed_weights_are_stored_as_out_in_rows():
    """GPT-OSS's [in, out] weight: the copy is of its transpose, and dequantizes back to the
    native layout."""
    w = _weight((40, 6))
    q, scale = quant.quantize_int8(w, transposed=True)
    q_t, scale_t = quant.quantize_int8(w.T.contiguous(), transposed=False)
    assert q.shape == (6, 40) and torch.equal(q, q_t) and torch.equal(scale, scale_t)
    assert quant.dequantize_int8(q, scale, transposed=True).shape == (40, 6)
    packed, s4 = quant.quantize_int4(w, transposed=True)
    assert packed.shape == (6, 32) and s4.shape == (6, 2)  # 40 inputs padded to 64
    assert quant.dequantize_int4(packed, s4, (40, 6), transposed=True).shape == (40, 6)


def test_int4_nibbles_scales_and_padding():
    """A hand-made row: the even input in the low nibble as q + 8, one float16 scale per group
    of 32 (the last group padded with zeros), dequantized exactly as stored."""
    s = 0.5
    row = torch.zeros(1, 37)
    row[0, 0], row[0, 1], row[0, 2] = 7 * s, -7 * s, 3 * s  # group 0: max 3.5 -> scale 0.5
    row[0, 33] = -0.7  # group 1 (inputs 32..36, padded to 64): scale 0.1
    packed, scale = quant.quantize_int4(row, transposed=False)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 32)
    assert scale.dtype == torch.float16 and scale.shape == (1, 2)
    assert scale[0, 0].item() == 0.5 and scale[0, 1] == torch.tensor(0.1).half()
    assert packed[0, 0] == (7 + 8) | ((-7 + 8) << 4)  # inputs 0 (low) and 1 (high)
    assert packed[0, 1] == (3 + 8) | (8 << 4)
    assert packed[0, 16] == 8 | ((-7 + 8) << 4)  # inputs 32 and 33
    assert torch.all(packed[0, 19:] == 0x88)  # the padding: zeros
    values = quant.unpack_int4(packed)
    assert values.shape == (1, 64) and values[0, 33] == -7
    back = quant.dequantize_int4(packed, scale, (1, 37), transposed=False)
    assert back.shape == (1, 37)
    expected = values[:, :37].float() * scale.float().repeat_interleave(32, dim=1)[:, :37]
    assert torch.equal(back, expected)


def test_int4_zero_group_and_clamp():
    w = torch.zeros(2, 64)
    w[1, 32:] = torch.linspace(-1, 1, 32)
    packed, scale = quant.quantize_int4(w, transposed=False)
    assert scale[0, 0] == 1 and scale[0, 1] == 1 and scale[1, 0] == 1  # zero groups
    values = quant.unpack_int4(packed)
    assert torch.all(values[0] == 0) and torch.all(values[1, :32] == 0)
    assert int(values.max()) <= 7 and int(values.min()) >= -8
    assert values[1, 63] == 7 and values[1, 32] == -7


def test_group_size_must_be_even():
    with pytest.raises(ValueError, match="even"):
        quant.quantize_int4(torch.ones(2, 6), transposed=False, group_size=3)


@pytest.mark.parametrize("native_shape, transposed, sizes", [
    # GPT-OSS at the e2e benchmark's shape: gate_up [H, 2I] and down [I, H], x @ W
    ((2880, 1210), True, {"int8": [1210 * 2880, 4 * 1210],
                          "int4": [1210 * 2880 // 2, 2 * 1210 * 90]}),
    ((605, 2880), True, {"int8": [2880 * 605, 4 * 2880],
                         "int4": [2880 * 608 // 2, 2 * 2880 * 19]}),
    # Qwen3-MoE's down_proj [H, I], F.linear
    ((1024, 480), False, {"int8": [1024 * 480, 4 * 1024],
                          "int4": [1024 * 480 // 2, 2 * 1024 * 15]}),
])
def test_copy_sizes(native_shape, transposed, sizes):
    for precision, nbytes in sizes.items():
        parts = quant.copy_parts(native_shape, transposed, precision)
        assert [p.role for p in parts] == ["q", "scale"]
        assert [p.nbytes for p in parts] == nbytes
        assert quant.copy_nbytes(native_shape, transposed, precision) == sum(nbytes)
        q, scale = quant.quantize(precision, torch.zeros(native_shape), transposed)
        assert [tuple(q.shape), tuple(scale.shape)] == [p.shape for p in parts]
        assert [q.nbytes, scale.nbytes] == nbytes


# --- QWeight and the kernels --------------------------------------------------------------------

@pytest.mark.parametrize("precision", quant.QUANTIZED)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("out, inputs", [(37, 605), (13, 50), (64, 96), (7, 33)])
@pytest.mark.parametrize("M", [1, 3, 6])
def test_products_match_the_dequantized_reference(kernel, precision, transposed, out, inputs,
                                                  M):
    """Odd shapes (in not a multiple of the group or of 16, out not a multiple of 4 or 16),
    one row of x or a few, in float32: each kernel gives x @ dequantize(W) to float
    tolerance."""
    native = (inputs, out) if transposed else (out, inputs)
    w = QWeight.quantize(_weight(native, seed=out * inputs), precision, transposed)
    x = torch.randn(M, inputs, generator=torch.Generator().manual_seed(M))
    reference = x @ (w.dequantize() if transposed else w.dequantize().T)
    y = x @ w if transposed else torch.nn.functional.linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (M, out)
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", quant.QUANTIZED)
@pytest.mark.parametrize("M", [1, 5])
def test_bf16_activations_give_the_float32_product_rounded(kernel, precision, M):
    """The worker's bf16 x: the C calls that widen x and round y themselves give exactly the
    float32 product rounded by torch."""
    w = QWeight.quantize(_weight((50, 37)), precision, transposed=True)
    x = torch.randn(M, 50, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16)
    y = x @ w
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (x.float() @ w).to(torch.bfloat16))


@pytest.mark.parametrize("simd", [1, 0])
def test_kernels_write_only_their_output(simd):
    """The C calls write M x out floats and nothing after them, and refuse shapes they do
    not take."""
    lib = quantized.load()
    if lib is None:
        pytest.skip(f"the C kernels: {quantized.why_not()}")
    before = lib.fm_qgemv_simd(-1)
    lib.fm_qgemv_simd(simd)
    try:
        M, out, inputs = 3, 13, 50
        q8, s8 = quant.quantize_int8(_weight((out, inputs)), transposed=False)
        q4, s4 = quant.quantize_int4(_weight((out, inputs)), transposed=False)
        x = torch.randn(M, 64)
        for call in (lambda y: lib.fm_q8_gemv(q8.data_ptr(), s8.data_ptr(), x.data_ptr(),
                                               y.data_ptr(), M, out, inputs),
                     lambda y: lib.fm_q4_gemv(q4.data_ptr(), s4.data_ptr(), x.data_ptr(),
                                               y.data_ptr(), M, out, 64, 32)):
            y = torch.full((M * out + 64,), float("nan"))
            assert call(y) == 0
            assert not y[:M * out].isnan().any() and y[M * out:].isnan().all()
        assert lib.fm_q4_gemv(q4.data_ptr(), s4.data_ptr(), x.data_ptr(), y.data_ptr(), M,
                              out, 50, 32) == -1  # in_pad not whole groups
        assert lib.fm_q8_gemv(q8.data_ptr(), s8.data_ptr(), x.data_ptr(), y.data_ptr(), M,
                              out, 0) == -1
    finally:
        lib.fm_qgemv_simd(before)


def test_torch_dispatch_and_attributes(kernel):
    w = _weight((48, 20))  # GPT-OSS style: native [in, out]
    qw = QWeight.quantize(w, "int8", transposed=True)
    assert qw.shape == (48, 20) and qw.dtype == torch.bfloat16 and qw.ndim == 2
    assert qw.T.shape == (20, 48) and not qw.T.transposed and qw.t().T.transposed
    x = torch.randn(2, 5, 48).to(torch.bfloat16)
    y = x @ qw
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 20)
    assert torch.equal(torch.matmul(x, qw), y)
    bias = torch.randn(20).to(torch.bfloat16)
    assert torch.equal(torch.nn.functional.linear(x, qw.T, bias), y + bias)
    with pytest.raises(TypeError, match="QWeight computes"):
        torch.nn.functional.linear(x, qw)  # an [in, out] weight is not F.linear's
    with pytest.raises(TypeError):  # (the @ operator turns the message into its own)
        x[..., :20] @ qw.T
    with pytest.raises(TypeError, match="QWeight computes"):
        torch.matmul(x[..., :20], qw.T)
    with pytest.raises(TypeError, match="QWeight computes"):
        torch.add(x, qw)
    with pytest.raises(ValueError, match="input of 47"):
        x[..., :47] @ qw


def test_views_of_the_wrong_layout_are_refused():
    q, scale = quant.quantize_int4(torch.zeros(8, 64), transposed=False)
    with pytest.raises(ValueError, match="contiguous CPU"):
        QWeight(q, scale.float(), "int4", (8, 64), False)
    with pytest.raises(ValueError, match="contiguous CPU"):
        QWeight(q, scale, "int4", (64, 8), False)
    with pytest.raises(ValueError, match="precision"):
        QWeight(q, scale, "int2", (8, 64), False)


# --- transformers' eager experts code on QWeights -----------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("precision", quant.QUANTIZED)
def test_eager_experts_of_every_family(kernel, family, precision):
    """A tiny model's experts module (transformers' own class, eager), its parameters swapped
    for per-expert QWeights: the output is that of the same module holding the dequantized
    weights, in float32, and in bf16 it runs too."""
    from flashmoe.tools.tiny_models import tiny_model

    model = tiny_model(family, layers=1, experts=4, top_k=2, hidden=64, expert_intermediate=40)
    (_, module), = FAMILIES[family].experts_modules(model)
    reference = module
    module = copy.deepcopy(module)
    quantize_experts_module(module, precision)
    assert isinstance(module.down_proj[1], QWeight)
    with torch.no_grad():  # the reference: the same code on the dequantized weights
        for name, parameter in reference.named_parameters(recurse=False):
            if parameter.dim() == 3:
                parameter.copy_(torch.stack([getattr(module, name)[e].dequantize()
                                             for e in range(parameter.shape[0])]))
    hidden = torch.randn(6, 64)
    index = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0], [3, 2]])
    weights = torch.softmax(torch.randn(6, 2), dim=-1)
    with torch.no_grad():
        expected = reference(hidden, index, weights)
        got = module(hidden, index, weights)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        bf16 = module(hidden.to(torch.bfloat16), index, weights.to(torch.bfloat16))
    assert bf16.dtype == torch.bfloat16
    assert (bf16.float() - expected).norm() / expected.norm() < 0.02
