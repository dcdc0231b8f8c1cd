"""``POST /v1/responses``: OpenAI's Responses API, the subset a chat client needs, answered
through the chat endpoint.

A request is turned into the chat request it stands for (:func:`chat_request`): ``instructions``
become a system message first, ``input`` (a string, or a list of messages, ``function_call`` and
``function_call_output`` items) the messages after it, ``tools`` (function tools, OpenAI's flat
shape) and ``tool_choice`` the chat's, ``text.format`` its ``response_format``,
``max_output_tokens`` its ``max_completion_tokens``.  The chat completion is then read back as
a response (:func:`response_body`): the reply's text as a ``message`` item of ``output_text``,
its calls as ``function_call`` items, its usage as ``input_tokens`` / ``output_tokens``, a reply
cut by ``max_output_tokens`` as status ``"incomplete"``.  Streamed, the chat's chunks become the
Responses API's events (:class:`EventWriter`): ``response.created``, ``response.in_progress``, the
text's ``response.output_text.delta`` as it is decoded, the calls' items at the end, and
``response.completed`` with the whole response; an error part-way ends the stream with an
``error`` event holding the OpenAI error object.

``previous_response_id``: the conversation a stored response ended (its input and output, not
its instructions, as OpenAI's) goes before the new input.  Responses are kept in this process's
memory (:class:`ResponseStore`: at most :data:`STORE_MAX` of them, each for :data:`STORE_TTL_S`),
each visible only to requests of the API key that made it; ``"store": false`` keeps none.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Literal, Optional, Union, cast

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from sse_starlette import EventSourceResponse

from llama.serve import openai_api as oa
from llama.serve.auth import cache_scope
from llama.serve.chat import create_chat_completion
from llama.serve.finite_json import dumps
from llama.serve.serving import OpenAIServing
from llama.serve.streaming import PING_S

ENDPOINT = "/v1/responses"
STORE_MAX = 1024  # responses kept for previous_response_id, the oldest dropped first
STORE_TTL_S = 3600.0  # seconds each is kept


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` (the fields read; others are accepted and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[StrictStr] = None
    input: Union[StrictStr, list[dict[str, Any]]]
    instructions: Optional[StrictStr] = None
    max_output_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: Optional[oa.Number] = None
    top_p: Optional[oa.Number] = None
    stream: StrictBool = False
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool = True
    text: Optional[dict[str, Any]] = None
    previous_response_id: Optional[StrictStr] = None
    store: StrictBool = True
    # the chat endpoint's extra fields, passed on
    seed: Optional[StrictInt] = None
    top_k: Optional[StrictInt] = None
    priority: StrictInt = 0
    timeout: Optional[oa.Number] = None
    cache_salt: Optional[StrictStr] = None


class ResponseStore:
    """Finished responses' conversations, by id, for ``previous_response_id``: at most ``max_items``,
    each for ``ttl_s`` seconds, each visible to its tenant scope alone (thread-safe)."""

    def __init__(self, max_items: int = STORE_MAX, ttl_s: float = STORE_TTL_S) -> None:
        self.max_items, self.ttl_s = max_items, ttl_s
        self._items: OrderedDict[str, tuple[Optional[str], float, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, scope: Optional[str], messages: list[dict]) -> None:
        with self._lock:
            self._drop_expired()
            self._items[response_id] = (scope, time.monotonic() + self.ttl_s, messages)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)

    def get(self, response_id: str, scope: Optional[str]) -> Optional[list[dict]]:
        """The conversation a response ended, or None (unknown, expired, or another tenant's)."""
        with self._lock:
            self._drop_expired()
            item = self._items.get(response_id)
            if item is None or item[0] != scope:
                return None
            return list(item[2])

    def _drop_expired(self) -> None:
        now = time.monotonic()
        while self._items:
            first = next(iter(self._items.values()))
            if first[1] > now:
                return
            self._items.popitem(last=False)


# -- the request as a chat request ---------------------------------------------------------


def input_messages(items: Union[str, list[dict[str, Any]]]) -> list[dict]:
    """The ``input`` as chat messages (OpenAI's chat shapes); a 400 naming the item at fault."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        param = f"input.{i}"
        if not isinstance(item, dict):
            raise oa.APIError(400, f"{param}: an input item must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise oa.APIError(400, f"{param}: role must be user, system, developer or assistant, not {role!r:.40}",
                                  param=param)
            messages.append({"role": role, "content": message_content(item.get("content"), param)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", "{}"), str):
                raise oa.APIError(400, f"{param}: a function_call item needs name and arguments (a JSON string)",
                                  param=param)
            call = {"id": item.get("call_id") or f"call_{i}", "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("content"):
                messages[-1].setdefault("tool_calls", []).append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output)
            messages.append({"role": "tool", "content": output, "tool_call_id": item.get("call_id")})
        else:
            raise oa.APIError(400, f"{param}: input items of type {kind!r:.40} are not supported (message, "
                                   "function_call, function_call_output are)", param=param)
    if not messages:
        raise oa.APIError(400, "input must hold at least one item", param="input")
    return messages


def message_content(content: Any, param: str) -> Any:
    """A message's content as the chat endpoint takes it: a string, or text and image parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise oa.APIError(400, f"{param}.content must be a string or a list of parts", param=param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"],
                                                             "detail": part.get("detail") or "auto"}})
        else:
            raise oa.APIError(400, f"{param}.content.{j}: a part must be input_text (with text) or input_image "
                                   f"(with image_url), not {kind!r:.40}", param=f"{param}.content.{j}")
    return parts


def chat_tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict]]:
    """Function tools (``{"type": "function", "name", "description", "parameters"}``) in the chat shape."""
    if tools is None:
        return None
    out = []
    for k, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise oa.APIError(400, f"tools.{k}: only function tools are supported ({{\"type\": \"function\", "
                                   "\"name\": ..., \"parameters\": {...}}})", param=f"tools.{k}")
        out.append({"type": "function", "function": {k2: tool[k2] for k2 in ("name", "description", "parameters")
                                                     if k2 in tool}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """``{"type": "function", "name"}`` in the chat shape; the strings as they are."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_response_format(text: Optional[dict[str, Any]]) -> Optional[dict]:
    """``text.format`` as the chat's ``response_format`` (json_schema's fields one level up here)."""
    fmt = (text or {}).get("format")
    if fmt is None or not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    return fmt


def chat_request(req: ResponsesRequest, history: list[dict]) -> oa.ChatCompletionRequest:
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) + \
        history + input_messages(req.input)
    body: dict[str, Any] = {"messages": messages, "parallel_tool_calls": req.parallel_tool_calls,
                            "stream": req.stream, "priority": req.priority}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for field, value in (("model", req.model), ("max_completion_tokens", req.max_output_tokens),
                         ("temperature", req.temperature), ("top_p", req.top_p), ("seed", req.seed),
                         ("top_k", req.top_k), ("timeout", req.timeout), ("cache_salt", req.cache_salt),
                         ("tools", chat_tools(req.tools)), ("tool_choice", chat_tool_choice(req.tool_choice)),
                         ("response_format", chat_response_format(req.text))):
        if value is not None:
            body[field] = value
    return oa.parse_request(dumps(body).encode("utf-8"), oa.ChatCompletionRequest)


# -- the chat completion as a response --------------------------------------------------------


def output_items(message: dict) -> list[dict]:
    """A chat reply's message as Responses output items: its text as a ``message``, its calls as
    ``function_call`` items."""
    items = []
    if message.get("content"):
        items.append(message_item(message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def message_item(text: str, status: str, item_id: Optional[str] = None) -> dict:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}


def response_usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def response_body(req: ResponsesRequest, response_id: str, created: int, model: str, output: list[dict],
                  finish_reason: Optional[str], usage: Optional[dict],
                  status: Literal["completed", "incomplete", "in_progress"]) -> dict:
    incomplete = status == "incomplete"
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": {},
        "output": output, "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "temperature": req.temperature, "top_p": req.top_p, "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [], "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": None if usage is None else response_usage(usage),
    }


def status_of(finish_reason: Optional[str]) -> Literal["completed", "incomplete"]:
    return "incomplete" if finish_reason == "length" else "completed"


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output as the chat messages a following turn sends back."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]


async def create_response(serving: OpenAIServing, store: ResponseStore, req: ResponsesRequest,
                          request: Request) -> Union[dict, EventSourceResponse]:
    scope = cache_scope(getattr(request.state, "api_key", None), None)  # a stored response is its key's alone
    history: list[dict] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id, scope)
        if found is None:
            raise oa.APIError(400, f"previous response {req.previous_response_id!r:.80} not found: it was never "
                                   f"stored here, was made with another API key, or is older than {STORE_TTL_S:g} s "
                                   "or than the last stored", param="previous_response_id",
                              code="previous_response_not_found")
        history = found
    chat = chat_request(req, history)
    conversation = history + input_messages(req.input)
    response_id, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    answer = await create_chat_completion(serving, chat, request, endpoint=ENDPOINT)

    def keep(output: list[dict]) -> None:
        if req.store:
            store.put(response_id, scope, conversation + output_messages(output))

    if isinstance(answer, dict):
        choice = answer["choices"][0]
        output = output_items(choice["message"])
        keep(output)
        return response_body(req, response_id, created, answer["model"], output, choice["finish_reason"],
                             answer["usage"], status_of(choice["finish_reason"]))
    writer = EventWriter(req, response_id, created, serving.model_name, keep)
    return EventSourceResponse(writer.events(cast(AsyncIterator[Any], answer.body_iterator)), ping=PING_S)


class EventWriter:
    """The Responses API's stream events of a streamed chat completion's chunks."""

    def __init__(self, req: ResponsesRequest, response_id: str, created: int, model: str, keep) -> None:
        self.req, self.response_id, self.created, self.model, self.keep = req, response_id, created, model, keep
        self.sequence = 0
        self.text = ""
        self.message_id: Optional[str] = None
        self.calls: dict[int, dict] = {}
        self.finish_reason: Optional[str] = None
        self.usage: Optional[dict] = None

    def event(self, kind: str, **fields: Any) -> dict:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return {"event": kind, "data": dumps(body)}

    def response(self, output: list[dict], status: Literal["completed", "incomplete", "in_progress"]) -> dict:
        return response_body(self.req, self.response_id, self.created, self.model, output, self.finish_reason,
                             self.usage, status)

    async def events(self, chunks: AsyncIterator[Any]) -> AsyncIterator[dict]:
        try:
            async for event in self._events(chunks):
                yield event
        finally:  # the chat's stream ends with this one (a client gone cancels its requests)
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()

    async def _events(self, chunks: AsyncIterator[Any]) -> AsyncIterator[dict]:
        yield self.event("response.created", response=self.response([], "in_progress"))
        yield self.event("response.in_progress", response=self.response([], "in_progress"))
        async for sent in chunks:
            data = sent["data"] if isinstance(sent, dict) else sent
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:  # the request failed part-way: OpenAI's error object ends the stream
                yield self.event("error", error=chunk["error"], code=chunk["error"].get("code"),
                                 message=chunk["error"].get("message"), param=chunk["error"].get("param"))
                return
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                for event in self.content(delta.get("content")):
                    yield event
                for call in delta.get("tool_calls") or []:
                    kept = self.calls.setdefault(call.get("index", len(self.calls)),
                                                 {"id": None, "name": None, "arguments": ""})
                    function = call.get("function") or {}
                    kept["id"] = call.get("id") or kept["id"]
                    kept["name"] = function.get("name") or kept["name"]
                    kept["arguments"] += function.get("arguments") or ""
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
        output = []
        if self.message_id is not None:
            item = message_item(self.text, "completed", self.message_id)
            yield self.event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                             text=self.text, logprobs=[])
            yield self.event("response.content_part.done", item_id=self.message_id, output_index=0,
                             content_index=0, part=item["content"][0])
            yield self.event("response.output_item.done", output_index=0, item=item)
            output.append(item)
        for k in sorted(self.calls):
            call = self.calls[k]
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"] or f"call_{k}",
                    "name": call["name"], "arguments": "", "status": "in_progress"}
            index = len(output)
            yield self.event("response.output_item.added", output_index=index, item=item)
            yield self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=call["arguments"])
            yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=call["arguments"])
            item = {**item, "arguments": call["arguments"], "status": "completed"}
            yield self.event("response.output_item.done", output_index=index, item=item)
            output.append(item)
        self.keep(output)
        status = status_of(self.finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self.event(kind, response=self.response(output, status))

    def content(self, piece: Optional[str]) -> list[dict]:
        """The events of a piece of the reply's text (the message item opened at the first)."""
        if not piece:
            return []
        events = []
        if self.message_id is None:
            self.message_id = f"msg_{uuid.uuid4().hex}"
            events.append(self.event("response.output_item.added", output_index=0,
                                     item=message_item("", "in_progress", self.message_id)))
            events.append(self.event("response.content_part.added", item_id=self.message_id, output_index=0,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                            "logprobs": []}))
        self.text += piece
        events.append(self.event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                 content_index=0, delta=piece, logprobs=[]))
        return events
