"""Checks that turn silently wrong numbers into clear errors.

A NaN or Inf in one weight spreads through every later layer: greedy decoding then
returns garbage with NaN log-probabilities, and sampling fails inside torch with a
message about probabilities.  Weights are checked once, tensor by tensor as they are
loaded (:func:`check_finite_weight`); logits where they are used
(:func:`check_finite_logits`); and temperatures are applied so that no positive
temperature can overflow the logits (:func:`scale_by_temperature`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Union

import torch

__all__ = [
    "NonFiniteError",
    "check_finite_logits",
    "check_finite_weight",
    "non_finite_flag",
    "scale_by_temperature",
]


class NonFiniteError(RuntimeError):
    """A tensor that must hold finite numbers holds NaN or Inf."""


def _count_non_finite(t: torch.Tensor) -> tuple[int, int]:
    """(NaNs, infinities) in ``t``."""
    return int(torch.isnan(t).sum()), int(torch.isinf(t).sum())


def check_finite_weight(
    tensor: torch.Tensor, name: str, path: Union[str, Path], source: Optional[torch.Tensor] = None
) -> None:
    """Raise :class:`NonFiniteError` naming the tensor and the file if ``tensor`` (a
    weight just loaded) holds NaN or Inf.  ``source``, the data it was copied from,
    tells a damaged file apart from values too large for the dtype loaded into.

    One reduction over data that is being copied anyway: cheap next to reading it
    from disk (and a single host sync per tensor).
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    # One fast pass: the sum is non-finite if any element is (NaN and Inf propagate).
    # If it is non-finite only because large finite values overflowed in the sum, the
    # element counts below say so.  (Summing in the tensor's own dtype: converting
    # bfloat16 to float32 on the way is much slower.)
    if bool(torch.isfinite(tensor.sum())):
        return
    nans, infs = _count_non_finite(tensor)
    if not (nans or infs):
        return
    if source is not None and source.dtype != tensor.dtype and not any(_count_non_finite(source)):
        raise NonFiniteError(
            f"{path}: tensor {name!r} holds values beyond the range of {tensor.dtype} ({infs} became infinite "
            f"when converted from {source.dtype}); load it in bfloat16 or float32 (dtype=...)"
        )
    raise NonFiniteError(
        f"{path}: tensor {name!r} holds {nans} NaN and {infs} infinite value(s); the checkpoint is "
        "damaged (or was saved from a diverged run). Download it again (download.sh verifies "
        "checksums) or re-convert it from its source."
    )


def non_finite_flag(logits: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on the logits' device: True if any logit is NaN or +-Inf.
    No host sync: a loop that already reads the device every few steps can OR these
    flags together and call :func:`check_finite_logits` only when one is set."""
    return ~torch.isfinite(logits).all()


def check_finite_logits(logits: torch.Tensor, where: str) -> None:
    """Raise :class:`NonFiniteError` if ``logits`` (float, any shape) hold NaN or Inf.

    ``where`` names the step for the message (e.g. ``"decode step 12"``).  -inf is
    refused too: the model's own logits never hold it (apply vocabulary or top-k masks
    after this check).  Costs one sum and one host sync; call it where the
    model's logits are consumed, before sampling.
    """
    # The sum is non-finite if any logit is (NaN and Inf propagate); finite logits whose
    # sum overflows are told apart by the counts below.  One pass over the logits:
    # ``isfinite(...).all()`` takes four, at every decoding step.
    if bool(torch.isfinite(logits.sum())):
        return
    nans, infs = _count_non_finite(logits)
    if not (nans or infs):
        return
    raise NonFiniteError(
        f"the model produced {nans} NaN and {infs} infinite logit(s) at {where}: its numbers overflowed "
        f"(dtype {logits.dtype}). If the weights are float32 or bfloat16 the checkpoint is probably damaged; "
        "with float16 weights, load with dtype='bfloat16' or 'float32' instead."
    )


def scale_by_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in float32, computed so that it cannot overflow:
    each row's maximum is subtracted first, so the best token gets 0 and every other
    one a finite or -inf value (probability 0), and softmax is unchanged
    (softmax is invariant to shifting a row).  Any finite temperature > 0 works: a tiny
    one (1e-38) leaves the best token alone at probability 1, as greedy would."""
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    # A temperature below float32's smallest normal number would round to 0 (and 0/0 is
    # NaN at the best token); at that size it is greedy decoding anyway.
    temperature = max(temperature, torch.finfo(torch.float32).tiny)
    logits = logits.float()
    return (logits - logits.amax(dim=-1, keepdim=True)) / temperature
