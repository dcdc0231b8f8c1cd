"""An OpenAI-compatible HTTP server in front of the model-parallel ranks.

    python -m llama.serve                                        # the bundled demo model on 127.0.0.1:8000
    torchrun --nproc_per_node 2 -m llama.serve --ckpt_dir Meta-Llama-3-8B-Instruct/ --port 8000

Every rank loads its share of the model and runs the engine's loop on its main thread
(``engine.run_forever``); the first rank also runs the HTTP server (uvicorn, in a thread),
turns requests into engine requests and streams their tokens back.  The other ranks never
see a client: they follow the first rank's plan for each step.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
with ``stream``: server-sent events ending in ``data: [DONE]``), ``POST /v1/responses`` (OpenAI's
Responses API, through the chat endpoint), ``POST /tokenize`` and ``POST /detokenize`` (vLLM's),
``GET /health``, ``GET /metrics`` (Prometheus, ours and vLLM's names), ``GET /`` (a chat page) and
``GET /props`` (what the page needs beside the API: model, defaults, suggestions).  Requests take
a ``priority`` and a ``timeout`` (``--request_timeout_s``: the engine orders and ends them).

Modules: :mod:`~llama.serve.app` (the application: routes, error handlers),
:mod:`~llama.serve.completions` and :mod:`~llama.serve.chat` (the two generating endpoints),
:mod:`~llama.serve.responses` (the Responses API over the chat endpoint, stored responses),
:mod:`~llama.serve.tokenize` (``/tokenize``, ``/detokenize``),
:mod:`~llama.serve.serving` (what they share: request checks, engine settings, submission),
:mod:`~llama.serve.streaming` (server-sent events), :mod:`~llama.serve.errors` (every failure
as an OpenAI error object), :mod:`~llama.serve.auth` (API keys, prefix-cache scopes),
:mod:`~llama.serve.protocols` (what the server needs of the engine),
:mod:`~llama.serve.openai_api` (request shapes and the error object),
:mod:`~llama.serve.requests` (engine requests seen from asyncio), :mod:`~llama.serve.metrics`,
:mod:`~llama.serve.server` (socket, ranks, command line), :mod:`~llama.serve.shutdown`
(signals, the grace period), :mod:`~llama.serve.middleware` (the API-key and shutdown gate,
the body limit), :mod:`~llama.serve.access` (the access log),
:mod:`~llama.serve.connections` (header timeout, connection cap), :mod:`~llama.serve.logs` (log
floods), :mod:`~llama.serve.limits` (the limits' defaults and reasons), :mod:`~llama.serve.media` (a chat
request's images: data URIs, allowed hosts and folders, limits), :mod:`~llama.serve.page` and
``static/chat.html`` (the chat page: conversations kept in the browser, markdown built as elements).

Faults: a full queue answers 429 with ``Retry-After``; a client that goes away cancels its
requests, streamed or not, at the engine's next step; if a step fails (a rank died or hung) the
requests in flight get an error and every process exits non-zero; SIGTERM/SIGINT stop taking
requests, let those in flight finish for the grace period, end the rest and exit (:mod:`~llama.serve.shutdown`).
"""

from __future__ import annotations

from llama.runtime.lazy import lazy_exports

# module -> the public names it defines; imported on first use, so that ``--help`` answers
# before torch and the web stack are imported
_EXPORTS = {
    "app": ("create_app",),
    "auth": ("cache_scope",),
    "chat": ("openai_reply", "encode_chat"),
    "metrics": ("ServerMetrics",),
    "limits": ("ServerLimits", "MediaLimits"),
    "server": ("bind_socket", "serve", "api_keys_from", "main", "cli"),
}

__all__ = [name for names in _EXPORTS.values() for name in names]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
