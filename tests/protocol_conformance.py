"""Read by the type checker only (``mypy``, run by ``.ci/run``; pytest does not collect it): the
engine, the model the server is given and the tests' fake engine meet the server's protocols
(:mod:`llama.serve.protocols`).  Each function assigns an implementation to a variable of the
protocol's type, which fails type checking when a method or attribute is missing or its
signature differs (``tests/test_serve_api.py`` checks the methods' parameter names at run time).
"""

from __future__ import annotations

from fake_engine import FakeEngine
from llama.engine import Engine, RequestHandle
from llama.engine.build import LoadedModel
from llama.serve.protocols import ServedEngine, ServedModel, ServedRequest


def engine_is_served(engine: Engine) -> ServedEngine:
    served: ServedEngine = engine
    return served


def fake_engine_is_served(engine: FakeEngine) -> ServedEngine:
    served: ServedEngine = engine
    return served


def loaded_model_is_served(model: LoadedModel) -> ServedModel:
    served: ServedModel = model
    return served


def request_handle_is_served(handle: RequestHandle) -> ServedRequest:
    served: ServedRequest = handle
    return served
