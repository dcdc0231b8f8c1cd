"""Every body the server writes is JSON: a number that JSON cannot hold (NaN, Infinity) never
leaves it, neither as a 500 (what ``json.dumps(allow_nan=False)`` raising would give) nor as
``-Infinity`` in an event (what plain ``json.dumps`` writes).

Non-finite numbers should not reach a body in the first place (the engine lists no masked token
among a reply's alternatives, :meth:`llama.engine.output.OutputProcessor.log_probs`); this is
the guard at the boundary, should one get there all the same.  Such a number is replaced and the
replacement logged (a warning naming the fields):

- ``-inf`` by :data:`NEGATIVE_INFINITY_STAND_IN` (``-9999.0``): the server's only numbers
  of this kind are log-probabilities, and -inf is the log-probability of an impossible token;
  OpenAI documents ``-9999.0`` as the log-probability of "very unlikely" tokens, and vLLM
  answers -inf with it too;
- ``NaN`` and ``+inf`` by ``null``: no number says what they would have meant.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)

__all__ = ["NEGATIVE_INFINITY_STAND_IN", "FiniteJSONResponse", "dumps", "finite"]

NEGATIVE_INFINITY_STAND_IN = -9999.0
# Fields named in the warning, at most (a body of 20 alternatives per token could hold thousands).
NAMED_FIELDS = 5


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps(obj, **kwargs)`` with every non-finite number replaced (see the module's
    docstring) and the replacement logged.  A body of finite numbers (every body, unless
    something upstream went wrong) is written in one pass, as ``json.dumps`` writes it."""
    kwargs["allow_nan"] = False
    try:
        return json.dumps(obj, **kwargs)
    except ValueError as e:
        if "Out of range float values" not in str(e):
            raise
    replaced: list[str] = []
    text = json.dumps(finite(obj, replaced), **kwargs)
    shown = ", ".join(replaced[:NAMED_FIELDS]) + (f" and {len(replaced) - NAMED_FIELDS} more"
                                                  if len(replaced) > NAMED_FIELDS else "")
    logger.warning("a response held %d numbers JSON cannot hold (%s); sent %s for -inf and null for NaN or +inf",
                   len(replaced), shown, NEGATIVE_INFINITY_STAND_IN)
    return text


def finite(obj: Any, replaced: list[str], path: str = "$") -> Any:
    """A copy of ``obj`` (dicts, lists, tuples, scalars) with its non-finite floats replaced;
    the path of each replaced number (``$.choices[0].logprobs...=-inf``) appended to ``replaced``."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        replaced.append(f"{path}={obj}")
        return NEGATIVE_INFINITY_STAND_IN if obj == -math.inf else None
    if isinstance(obj, dict):
        return {k: finite(v, replaced, f"{path}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v, replaced, f"{path}[{i}]") for i, v in enumerate(obj)]
    return obj


class FiniteJSONResponse(JSONResponse):
    """Starlette's ``JSONResponse`` written by :func:`dumps` (the same bytes for any body of
    finite numbers): the server's default response class."""

    def render(self, content: Any) -> bytes:
        return dumps(content, ensure_ascii=False, indent=None, separators=(",", ":")).encode("utf-8")
