"""The engine's choice of the next token at temperatures the API accepts: one near 0 (1e-300
passes the [0, 2] range check) is greedy, not a NaN that killed the model loop."""

import types

import torch

from services.inference_worker.engine import Engine, SamplingParams


def choose(temperature: float, logits: torch.Tensor, top_p: float = 1.0) -> int:
    seq = types.SimpleNamespace(
        request=types.SimpleNamespace(params=SamplingParams(temperature=temperature,
                                                            top_p=top_p)),
        generator=torch.Generator().manual_seed(0))
    return Engine._choose(None, seq, logits)


def test_a_temperature_near_zero_is_greedy():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for t in (1.6694265560623982e-264, 1e-300, 5e-324, 1e-6):
        assert choose(t, logits) == int(logits.argmax())
        assert choose(t, logits, top_p=0.95) == int(logits.argmax())


def test_large_logits_at_a_small_temperature_do_not_overflow():
    logits = torch.tensor([3.0e38, 2.9e38, -3.0e38])
    assert choose(1e-3, logits) == 0


def test_stream_options_that_is_not_an_object_is_a_400():
    """``"stream_options": true`` was read as a mapping after the request was queued: 500."""
    import pytest

    from services.inference_worker.api import APIError, sampling_params

    for value in (True, 3, "x", [1]):
        with pytest.raises(APIError) as refused:
            sampling_params({"stream_options": value})
        assert refused.value.status == 400 and refused.value.param == "stream_options"
    sampling_params({"stream_options": {"include_usage": True}})
    sampling_params({"stream_options": None})
