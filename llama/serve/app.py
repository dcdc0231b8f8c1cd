"""The FastAPI application: the routes, the gate in front of them (API keys, shutdown) and the
error handlers, over the endpoints of :mod:`~llama.serve.completions` and :mod:`~llama.serve.chat`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional, Sequence

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import FileResponse, JSONResponse, Response
    from pydantic import BaseModel
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(f"the server needs its extra packages ({e.name} is missing): pip install 'llama[serve]'") from e

from llama.serve import openai_api as oa
from llama.serve.access import AccessLog
from llama.serve.auth import APIKeys
from llama.serve.chat import create_chat_completion
from llama.serve.completions import create_completion
from llama.serve.errors import error_response, install_error_handlers
from llama.serve.finite_json import FiniteJSONResponse
from llama.serve.limits import DEFAULT_MAX_REQUEST_BYTES, MediaLimits
from llama.serve.metrics import ServerMetrics
from llama.serve.middleware import BodyLimit, Gate
from llama.serve.page import GENERIC_SUGGESTIONS
from llama.serve.protocols import ServedModel
from llama.serve.responses import ResponsesRequest, ResponseStore, create_response
from llama.serve.serving import OpenAIServing
from llama.serve.tokenize import detokenize, tokenize

CHAT_PAGE = Path(__file__).resolve().parent / "static" / "chat.html"


def create_app(llama: ServedModel, model_name: str, max_queue: Optional[int] = None, *,
               api_keys: Sequence[str] = (), shared_prefix_cache: bool = False,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               tool_prompt_format: Optional[str] = None,
               chat_suggestions: Sequence[str] = GENERIC_SUGGESTIONS,
               media: Optional[MediaLimits] = None, request_timeout_s: Optional[float] = None) -> FastAPI:
    """The FastAPI application serving ``llama`` (a :class:`~llama.engine.build.LoadedModel`, as
    the command line builds it, a :class:`llama.Llama`, or anything with their ``engine``,
    ``tokenizer`` and ``formatter``: :class:`~llama.serve.protocols.ServedModel`).

    ``max_queue``: most requests left waiting once max_batch_size run; a request that
    would exceed it answers 429 (so does the engine's own ``EngineBusy``).  Requests that
    arrive together while rows are free are not counted against it, although the engine
    queues them all until its next step.

    ``api_keys``: when given, every request but the chat page (``/``) and ``/health`` (the API,
    ``/metrics``, ``/docs`` and ``/openapi.json`` among them) must carry ``Authorization: Bearer
    KEY`` with one of them (else 401: :class:`~llama.serve.middleware.Gate`).  Cached prompt prefixes are
    then shared only among requests of the same key (:func:`~llama.serve.auth.cache_scope`),
    unless ``shared_prefix_cache``; a request's ``cache_salt`` narrows its scope further.

    ``max_request_bytes``: larger bodies are refused with 413 before they are read
    (:class:`~llama.serve.middleware.BodyLimit`).

    ``tool_prompt_format``: how a chat request's ``tools`` are declared to the model and
    how its calls are written (``"json"``, ``"function_tag"``: Llama 3.1; ``"python_list"``:
    Llama 3.2, 3.3, 4); default: the model's own (Llama 3: ``"json"``; Llama 4:
    ``"python_list"``, its only one).  See :func:`llama.formats.tool_prompts.apply_tools`.

    ``chat_suggestions``: the prompts the chat page's suggestion buttons offer, given by
    ``GET /props`` (:func:`llama.serve.page.chat_suggestions` picks them for a checkpoint).

    ``media``: where a chat request's images may come from and how many, how large
    (:class:`~llama.serve.limits.MediaLimits`; default: data URIs only, its default limits).
    ``GET /props`` says whether the model takes images (``images``) and these limits.

    ``request_timeout_s``: seconds after which a request is ended, running or waiting, its
    blocks freed (504, code ``request_timeout``); a request's ``timeout`` may shorten it, not
    lengthen it (None: only requests that give a ``timeout`` have a deadline).

    ``app.state.accepting``: set it to False to answer new ``/v1/*`` requests with 503 (shutdown).
    """
    engine = llama.engine
    metrics = ServerMetrics(engine, model_name)
    keys = APIKeys(api_keys)
    app = FastAPI(title="llama", description="OpenAI-compatible Llama server", docs_url="/docs", redoc_url=None,
                  default_response_class=FiniteJSONResponse)  # every number in a body is JSON
    app.state.metrics = metrics
    app.state.accepting = True
    serving = OpenAIServing(llama, model_name, metrics, max_queue=max_queue, shared_prefix_cache=shared_prefix_cache,
                            tool_prompt_format=tool_prompt_format,
                            accepting=lambda: app.state.accepting, media=media,
                            request_timeout_s=request_timeout_s)
    install_error_handlers(app, metrics)
    # (added first, so that it runs inside the gate: a request without its key gets its 401)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes,
                       respond=lambda path, e: error_response(metrics, path, e))

    app.add_middleware(Gate, keys=keys, accepting=lambda: app.state.accepting,
                       respond=lambda path, e: error_response(metrics, path, e))
    app.add_middleware(AccessLog)  # (added last: the outermost, it sees every answer)

    @app.get("/health")
    async def health():
        # Up or not, nothing more: counters (cached prompt tokens above all) would let one client
        # learn about another's requests.  Operators read /metrics, behind the API key.
        if not app.state.accepting:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/")
    async def chat_page():
        return FileResponse(CHAT_PAGE, media_type="text/html")

    @app.get("/props")
    async def props():
        # What the chat page needs beside the API (as llama.cpp's server's /props): the model, its
        # context, the sampling defaults a request gets and suggestions that fit the model.
        fields = oa.ChatCompletionRequest.model_fields
        return {"model": model_name, "max_model_len": engine.max_seq_len,
                "defaults": {"temperature": fields["temperature"].default, "top_p": fields["top_p"].default},
                "suggestions": list(chat_suggestions),
                # Whether the chat page offers to attach pictures: the model's chat format takes them.
                "images": serving.formatter.image_layout is not None,
                "max_images_per_request": serving.media.max_images_per_request,
                "max_image_bytes": serving.media.max_image_bytes}

    @app.get("/v1/models")
    async def models():
        metrics.requests.labels("/v1/models", "200").inc()
        base = {"id": model_name, "object": "model", "created": serving.created, "owned_by": "llama",
                "root": model_name, "parent": None, "max_model_len": engine.max_seq_len}
        # Each LoRA adapter as vLLM lists it: its parent the base, its root the folder it came from.
        adapters = [{**base, "id": name, "root": path, "parent": model_name}
                    for name, path in serving.adapters.items()]
        return {"object": "list", "data": [base, *adapters]}

    # The bodies are read by read_request (not by FastAPI), so that every way a body can be
    # wrong is answered the same way; /docs still shows their shapes (document_bodies).
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(serving, await read_request(request, oa.CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(serving, await read_request(request, oa.ChatCompletionRequest), request)

    responses = ResponseStore()  # for previous_response_id: in memory, bounded, per API key

    @app.post("/v1/responses")
    async def create_responses(request: Request):
        return await create_response(serving, responses, await read_request(request, ResponsesRequest), request)

    # vLLM's paths (not under /v1), behind the API key as the rest of the API.
    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await tokenize(serving, await read_request(request, oa.TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await detokenize(serving, await read_request(request, oa.DetokenizeRequest))

    document_bodies(app, {"/v1/completions": oa.CompletionRequest, "/v1/chat/completions": oa.ChatCompletionRequest,
                          "/tokenize": oa.TokenizeRequest, "/detokenize": oa.DetokenizeRequest,
                          "/v1/responses": ResponsesRequest})
    return app


# Bodies up to this size are parsed on the event loop; larger ones on a thread, so that
# /health and the streams of other requests keep answering meanwhile.
PARSE_INLINE_BYTES = 64 * 1024


async def read_request(request: Request, model: type[oa.R]) -> oa.R:
    """The request's JSON body checked into ``model`` (:func:`~llama.serve.openai_api.parse_request`)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if not (content_type == "application/json" or content_type.endswith("+json")):
        raise oa.APIError(400, f"the request body must be JSON sent with 'Content-Type: application/json' "
                               f"(got {content_type or 'no Content-Type'})")
    body = await request.body()
    if len(body) <= PARSE_INLINE_BYTES:
        return oa.parse_request(body, model)
    return await asyncio.to_thread(oa.parse_request, body, model)


def document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Put the request bodies' JSON schemas into the OpenAPI document (/docs)."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
