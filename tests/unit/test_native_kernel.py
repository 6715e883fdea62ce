"""Native bf16 experts: ``fm_bf16_gemv`` (csrc/fm_qgemv.c, through ``quantized.bf16_products``)
against torch's bf16 product, and the trace worker's ``experts_forward``
(services/inference_worker/trace_compute.py) against transformers' eager experts forward of
every family: bit-identical where both multiply through torch, to a bf16 rounding of the
products through the kernel."""

import copy
import ctypes
import json

import pytest
import torch

from common.model_families import FAMILIES
from services.inference_worker import quantized
from services.inference_worker.quantized import QWeight, bf16_products
from services.inference_worker.trace_compute import TraceExperts, experts_forward

KERNELS = ("avx512_bf16", "portable")
BF16 = torch.bfloat16


@pytest.fixture(params=KERNELS)
def kernel(request):
    """Each C kernel in turn; one the library or the CPU does not have skips with the
    reason."""
    lib = quantized.load()
    if lib is None:
        pytest.skip(f"the C kernels: {quantized.why_not()}")
    simd = lib.fm_qgemv_simd(-1)
    lib.fm_qgemv_simd(1 if request.param == "avx512_bf16" else 0)
    try:
        if quantized.native_kernel() != request.param:
            pytest.skip("this CPU has no AVX-512 BF16")
        yield request.param
    finally:
        lib.fm_qgemv_simd(simd)


@pytest.fixture
def torch_only(monkeypatch):
    """No C library: bf16_products answers None and every product is torch's."""
    monkeypatch.setattr(quantized, "load", lambda: None)


def _randn(*shape, seed, scale=1.0, dtype=BF16):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _torch_product(x, w, transposed):
    return x @ w if transposed else torch.nn.functional.linear(x, w)


# --- the kernel ---------------------------------------------------------------------------------

@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("inputs, out", [(96, 130), (37, 45), (1, 3), (64, 2051), (2051, 17)])
def test_products_are_torchs_to_a_bf16_rounding(kernel, transposed, inputs, out):
    """Odd shapes (tails of 32 columns and of 16, an odd row count, one input, more outputs
    than a pass of accumulators): each element is torch's bf16 product or one bf16 step from
    it (the float32 sums differ in order only), and most are torch's exactly."""
    native = (inputs, out) if transposed else (out, inputs)
    weights = [_randn(*native, seed=s, scale=0.05) for s in range(3)]
    x = _randn(1, inputs, seed=7)
    y = bf16_products(x, weights, None, transposed)
    assert y.dtype == BF16 and y.shape == (3, out)
    want = torch.cat([_torch_product(x, w, transposed) for w in weights])
    steps = (y.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert int(steps.max()) <= 1
    assert float((steps == 0).float().mean()) > 0.95


@pytest.mark.parametrize("transposed", [True, False])
def test_bias_rows_and_the_shared_row(kernel, transposed):
    """The bias is added to the rounded product and rounded again (torch's x @ W + b in bf16,
    exactly); x of one row serves every weight, x of n rows one each."""
    inputs, out = 50, 70
    native = (inputs, out) if transposed else (out, inputs)
    weights = [_randn(*native, seed=s, scale=0.05) for s in range(4)]
    biases = [_randn(out, seed=10 + s) for s in range(4)]
    rows = _randn(4, inputs, seed=3)
    plain = bf16_products(rows, weights, None, transposed)
    assert torch.equal(bf16_products(rows, weights, biases, transposed),
                       plain + torch.stack(biases))
    for j in range(4):
        assert torch.equal(bf16_products(rows[j:j + 1], weights[j:j + 1], None, transposed),
                           plain[j:j + 1])
    shared = bf16_products(rows[:1], weights, None, transposed)
    assert torch.equal(shared[2:3], bf16_products(rows[:1], weights[2:3], None, transposed))


def test_the_kernels_agree_exactly_where_the_sums_are_exact():
    """Small integers: every partial sum is exact in float32, so the AVX-512 BF16 kernel,
    the portable loops and torch give the same bits whatever their order."""
    lib = quantized.load()
    if lib is None:
        pytest.skip(f"the C kernels: {quantized.why_not()}")
    gen = torch.Generator().manual_seed(0)
    for transposed in (True, False):
        w = torch.randint(-8, 8, (200, 33), generator=gen).to(BF16)
        x = torch.randint(-8, 8, (1, 200 if transposed else 33), generator=gen).to(BF16)
        want = _torch_product(x, w, transposed)
        simd = lib.fm_qgemv_simd(-1)
        try:
            for enable in (1, 0):
                lib.fm_qgemv_simd(enable)
                assert torch.equal(bf16_products(x, [w], None, transposed), want)
        finally:
            lib.fm_qgemv_simd(simd)


def test_kernel_writes_only_its_output_and_refuses_what_it_does_not_take(kernel):
    lib = quantized.load()
    w = _randn(40, 24, seed=1)
    x = _randn(1, 40, seed=2)
    pointers = (ctypes.c_void_p * 2)(w.data_ptr(), w.data_ptr())
    y = torch.full((2 * 24 + 40,), float("nan"), dtype=BF16)
    assert lib.fm_bf16_gemv(2, pointers, None, x.data_ptr(), 0, y.data_ptr(), 24, 40, 1) == 0
    assert not y[:48].isnan().any() and y[48:].isnan().all()
    assert lib.fm_bf16_gemv(2, pointers, None, x.data_ptr(), 0, y.data_ptr(), 0, 40, 1) == -1
    assert lib.fm_bf16_gemv(-1, pointers, None, x.data_ptr(), 0, y.data_ptr(), 24, 40, 1) == -1
    for bad in ([w.float()], [w.T], [w, w[:39]]):
        with pytest.raises(ValueError, match="bf16_products takes"):
            bf16_products(x, bad, None, True)
    with pytest.raises(ValueError, match="bf16_products takes"):
        bf16_products(x, [w], [_randn(23, seed=3)], True)
    with pytest.raises(ValueError, match="bf16_products takes"):
        bf16_products(_randn(3, 40, seed=4), [w, w], None, True)  # 3 rows for 2 weights


# --- experts_forward against transformers' eager forward ----------------------------------------

def _experts_module(family: str, dtype: torch.dtype):
    """A tiny model's experts module (transformers' own class, eager) with random weights
    and biases, in ``dtype``."""
    from flashmoe.tools.tiny_models import tiny_model

    model = tiny_model(family, layers=1, experts=6, top_k=3, hidden=64, expert_intermediate=40)
    (_, module), = FAMILIES[family].experts_modules(model)
    return module.to(dtype)


def _slices(module) -> dict[int, dict]:
    """expert -> its slice of each parameter (what a fetch hands the worker)."""
    params = dict(module.named_parameters(recurse=False))
    n = next(iter(params.values())).shape[0]
    return {e: {name: p.detach()[e] for name, p in params.items()} for e in range(n)}


ROUTES = [([4, 0, 2], [0.5, 0.3, 0.2]), ([1, 5, 3], [0.2, 0.45, 0.35]), ([2, 3, 1], [1.0, 0, 0])]


def _eager(module, hidden, experts, weights):
    with torch.no_grad():
        return module(hidden, torch.tensor([experts]),
                      torch.tensor([weights], dtype=hidden.dtype))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_through_torch_it_is_the_eager_forward_bit_for_bit(torch_only, family, dtype):
    """The experts in ascending id, the router's weights rounded to the dtype, each row
    through the family's gate alone, the weighted rows added one after another: the eager
    loop's arithmetic in its order, the same bits in float32 and in bf16."""
    module = _experts_module(family, dtype)
    params = _slices(module)
    for seed, (experts, weights) in enumerate(ROUTES):
        hidden = _randn(1, 64, seed=seed, dtype=dtype)
        with torch.no_grad():
            got = experts_forward(module, hidden, experts, weights, params, dtype)
        assert torch.equal(got, _eager(module, hidden, experts, weights))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_through_the_kernel_it_is_the_eager_forward_to_a_bf16_rounding(kernel, family):
    """bf16 weights, both kernels, both layouts (GPT-OSS [in, out], the others [out, in]):
    the products differ from torch's by at most a bf16 step, and the output by no more than
    such steps carried through the gate and the down projection."""
    module = _experts_module(family, BF16)
    params = _slices(module)
    for seed, (experts, weights) in enumerate(ROUTES):
        hidden = _randn(1, 64, seed=seed)
        with torch.no_grad():
            got = experts_forward(module, hidden, experts, weights, params, BF16)
        want = _eager(module, hidden, experts, weights)
        assert got.dtype == BF16 and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6,
                                   atol=2 ** -6 * float(want.float().abs().max()))


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_a_layer_of_copies_and_native_weights_is_computed_expert_by_expert(torch_only, family):
    """Precision copies (QWeights) among native weights: each expert alone, as the eager
    loop computes it, through the same QWeight products: the same bits in float32."""
    module = _experts_module(family, torch.float32)
    transposed = bool(module.is_transposed)
    params = _slices(module)
    for e in (0, 2, 4):
        params[e] = {name: QWeight.quantize(t, "int8", transposed) if t.dim() == 2 else t
                     for name, t in params[e].items()}
    eager = copy.deepcopy(module)
    for name in list(dict(module.named_parameters(recurse=False))):
        delattr(eager, name)
        object.__setattr__(eager, name, quantized.ExpertSlices([params[e][name]
                                                                for e in sorted(params)]))
    for seed, (experts, weights) in enumerate(ROUTES):
        hidden = _randn(1, 64, seed=seed, dtype=torch.float32)
        with torch.no_grad():
            got = experts_forward(module, hidden, experts, weights, params, torch.float32)
        assert torch.equal(got, _eager(eager, hidden, experts, weights))


def test_trace_experts_fetch_one_request_a_layer_and_drop_the_layer_before(tmp_path):
    """The trace worker's step: one fetch a layer, its experts in the trace's order without
    repeats, releasing the layer fetched before; the hidden state stays bf16 and finite."""
    from flashmoe.tools.tiny_models import tiny_config

    config = tiny_config("gpt_oss", layers=2, experts=6, top_k=3, hidden=64,
                         expert_intermediate=40)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    module = _experts_module("gpt_oss", BF16)
    params = _slices(module)
    calls = []

    def fetch(layer, experts, release, token, weights=()):
        calls.append((layer, list(experts), list(release), token,
                       [round(w, 6) for w in weights]))
        return [params[e] for e in experts]

    compute = TraceExperts(tmp_path, fetch)
    assert sorted(compute.experts) == [0, 1]
    hidden = compute.new_token("tok")
    hidden = compute.step(hidden, 0, [4, 0, 2], [0.5, 0.3, 0.2])
    hidden = compute.step(hidden, 1, [3, 5, 3], [0.4, 0.4, 0.2])
    # one request per layer, a repeated expert once with its weights summed
    assert calls == [(0, [4, 0, 2], [], "tok", [0.5, 0.3, 0.2]),
                     (1, [3, 5], [0], "tok", [0.6, 0.4])]
    assert hidden.dtype == BF16 and hidden.shape == (1, 64) and hidden.isfinite().all()
