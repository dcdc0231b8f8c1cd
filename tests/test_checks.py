"""Non-finite logits and temperatures that would overflow them become clear errors."""

from __future__ import annotations

import pytest
import torch

from llama.engine.sampling import SamplingParams, sample_next_token
from llama.runtime.finite import (
    NonFiniteError,
    check_finite_logits,
    check_finite_weight,
    non_finite_flag,
    scale_by_temperature,
)


def test_finite_logits_pass_and_non_finite_are_named():
    logits = torch.randn(2, 50)
    check_finite_logits(logits, "decode step 3")  # no error
    assert not bool(non_finite_flag(logits))
    for bad in (float("nan"), float("inf"), -float("inf")):
        damaged = logits.clone()
        damaged[1, 7] = bad
        assert bool(non_finite_flag(damaged))
        with pytest.raises(NonFiniteError, match=r"at decode step 3: its numbers overflowed") as info:
            check_finite_logits(damaged, "decode step 3")
        assert isinstance(info.value, RuntimeError)
        nans, infs = (1, 0) if bad != bad else (0, 1)
        assert f"{nans} NaN and {infs} infinite" in str(info.value)


def test_logit_check_is_not_fooled_by_a_sum_that_overflows():
    """The logit check sums the logits: huge finite logits whose float32 sum overflows
    pass, and one NaN or Inf among them is still caught."""
    big = torch.full((2, 1000), 3e38)  # each row sums to 3e41: beyond float32, every value finite
    assert not torch.isfinite(big.sum())
    check_finite_logits(big, "decode step 1")
    for bad in (float("nan"), -float("inf")):
        damaged = big.clone()
        damaged[0, 5] = bad
        with pytest.raises(NonFiniteError, match="at decode step 1"):
            check_finite_logits(damaged, "decode step 1")


def test_weight_check_is_not_fooled_by_a_sum_that_overflows():
    """Large finite values whose sum overflows are not a damaged tensor."""
    big = torch.full((1000,), 6e4, dtype=torch.float16)  # sum 6e7 overflows float16, every value is finite
    assert not torch.isfinite(big.sum())
    check_finite_weight(big, "w", "f.pth")
    big[3] = float("nan")
    with pytest.raises(NonFiniteError, match=r"f\.pth: tensor 'w' holds 1 NaN"):
        check_finite_weight(big, "w", "f.pth")


def test_tiny_temperature_samples_the_best_token():
    """The bug this fixes: 1e-38 passed SamplingParams and then the naive division's NaN
    probabilities failed inside torch ("probability tensor contains ...").  Now any
    positive temperature works; a tiny one is greedy."""
    logits = torch.tensor([[30.0, 10.0, -20.0]])  # 30 / 1e-38 overflows float32
    naive = torch.softmax(logits / 1e-38, dim=-1)
    assert torch.isnan(naive).any()
    g = torch.Generator().manual_seed(0)
    for t in (1e-38, 1e-300, 5e-324):
        assert int(sample_next_token(logits, SamplingParams(temperature=t), g)[0]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scaling_cannot_overflow_and_keeps_the_distribution(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 1000, generator=g) * 30).to(dtype)
    # A tiny temperature: finite, the argmax gets all the probability.
    probs = torch.softmax(scale_by_temperature(logits, 1e-38), dim=-1)
    assert torch.isfinite(probs).all()
    assert torch.equal(probs.argmax(-1), logits.float().argmax(-1))
    assert torch.allclose(probs.max(-1).values, torch.ones(4))
    # Ordinary temperatures: the same distribution as the textbook formula in float64.
    for t in (0.3, 0.6, 1.0, 2.5):
        expected = torch.softmax(logits.double() / t, dim=-1)
        got = torch.softmax(scale_by_temperature(logits, t), dim=-1).double()
        assert (got - expected).abs().max() < 1e-6
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            scale_by_temperature(logits, bad)
