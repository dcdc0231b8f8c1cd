"""The OpenAI API's request shapes, error object and token pieces, as the server speaks them.

Only what ``llama.serve`` needs: a request body read as JSON (:func:`parse_request`: UTF-8,
no NaN, bounded nesting, no lone surrogates), pydantic models that check a request's types
and ranges (an unknown extra field is accepted and ignored, as OpenAI clients send many), the
``{"error": {...}}`` object every failure answers with, and the text/bytes of one token for
log-probability listings.  No engine or HTTP code lives here.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Sequence, TypeVar, Union, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from llama.runtime.options import MAX_TOP_LOGPROBS
from llama.tokenizer import SentencePieceTokenizer, TiktokenTokenizer, Tokenizer

__all__ = [
    "APIError",
    "parse_request",
    "validation_error",
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "ImageRef",
    "TokenizeRequest",
    "DetokenizeRequest",
    "error_body",
    "token_piece",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "MAX_TOP_LOGPROBS",
]

# OpenAI's default for /v1/completions; chat requests default to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_N = 16

Number = Union[StrictInt, StrictFloat]


class APIError(Exception):
    """A request the server answers with an OpenAI error object and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- reading a body --

# Deeper than any request needs (a tool's JSON schema nests a handful of levels).  json.loads
# alone would go on to about 1,000 levels and then raise RecursionError.
MAX_JSON_DEPTH = 64
# A \uD800-\uDFFF escape: json.loads joins valid pairs; one left alone is not Unicode text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

R = TypeVar("R", bound=BaseModel)


def parse_request(body: bytes, model: type[R]) -> R:
    """The request ``body`` checked into ``model``; a 400 :class:`APIError` saying what is wrong
    with it otherwise: not UTF-8, not JSON (NaN and Infinity are not JSON, integers have at most
    4,300 digits), nested more than :data:`MAX_JSON_DEPTH` levels, a string holding a lone
    surrogate (``"\\ud800"``: not text any tokenizer can take), or a field pydantic refuses."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {body[e.start]:#04x} at offset {e.start}); "
                            "send JSON encoded as UTF-8") from None
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as e:  # JSONDecodeError, NaN, an integer of more digits than Python converts
        if "integer string conversion" in str(e):
            reason = f"an integer has more than {sys.get_int_max_str_digits()} digits"
        else:
            reason = str(e)
        raise APIError(400, f"the request body is not valid JSON: {reason}") from None
    # The tree is walked only where it can hold what the walk looks for.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(body):
        _check_tree(obj)
    if not isinstance(obj, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(obj).__name__}")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def _check_tree(obj: Any) -> None:
    """Nesting depth and strings of a parsed body (iteratively: the body may be deep)."""
    stack: list[tuple[Any, int, str]] = [(obj, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(
                    400, f"{path or 'body'}: the string holds a lone surrogate (\\u{ord(value[e.start]):04x} at index "
                         f"{e.start}), which is not Unicode text", param=path or None) from None
            continue
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise APIError(400, f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    stack.append((key, depth + 1, path))
                stack.append((item, depth + 1, f"{path}.{key}" if path else str(key)))


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """A 400 naming the first field pydantic refused (``errors``: ``ValidationError.errors()``)."""
    first = errors[0] if errors else {}
    # The field's path, without FastAPI's "body" and pydantic's union-member tags ("int", "list[str]", ...).
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_union_tag(x)]
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON: " + first.get("ctx", {}).get("error", ""))
    param = ".".join(loc) or None
    return APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param)


def _is_union_tag(loc: object) -> bool:
    return isinstance(loc, str) and (loc in {"int", "float", "str", "bool", "none"} or "[" in loc or "-" in loc)


class _Request(BaseModel):
    # Strict: "0.5" is not a temperature.  Extra fields (user, presence_penalty, ...) are ignored.
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[StrictStr] = None
    temperature: Number = Field(0.6, ge=0.0, le=2.0)  # Meta's generation defaults for Llama
    top_p: Number = Field(0.9, gt=0.0, le=1.0)
    top_k: Optional[StrictInt] = Field(None, ge=1)  # not OpenAI's; accepted as an extra field
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: Optional[StrictInt] = None
    stream: StrictBool = False
    stream_options: Optional["StreamOptions"] = None
    # vLLM's field: requests with different salts never share cached prompt prefixes.
    cache_salt: Optional[StrictStr] = Field(None, min_length=1)
    # Ours: false turns speculative decoding (--speculative) off for this request (the same tokens,
    # without the work of checking proposals).
    speculative: StrictBool = True
    # OpenAI's shapes ({"type": "json_object"}, {"type": "json_schema", ...}) and ours ("regex",
    # "grammar"); checked and compiled by llama.structured (a 400 naming the field otherwise).
    response_format: Optional[dict] = None
    # vLLM's: waiting requests start lowest value first (ties: arrival), and a full KV cache
    # preempts the highest value first.
    priority: StrictInt = 0
    # Ours (vLLM has none): seconds after which the request is ended, running or waiting
    # (504, code "request_timeout"); the server's --request_timeout_s caps it.
    timeout: Optional[Number] = Field(None, gt=0)

    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings, checked as the library checks them (how many, how long: a 400)."""
        from llama.engine.detokenize import check_stop_strings

        try:
            return check_stop_strings(self.stop)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), param="stop") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: StrictBool = False


class CompletionRequest(_Request):
    """``POST /v1/completions``: one or several prompts (text or token ids)."""

    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=0)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be an empty list", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [cast(list[int], list(p))]  # one prompt of token ids
        return cast(list[Union[str, list[int]]], list(p))  # several prompts


@dataclass(frozen=True)
class ImageRef:
    """An ``image_url`` content part not yet read: its ``url`` (a data URI, an http(s) URL or a
    local path), at part ``j`` of message ``i`` (:mod:`llama.serve.media` reads it)."""

    url: str
    i: int
    j: int

    @property
    def param(self) -> str:
        return f"messages.{self.i}.content.{self.j}"

    @property
    def where(self) -> str:
        return f"messages[{self.i}].content[{self.j}]"


IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's; Llama 4 tiles every image the same way


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "ipython"]
    # A string, or OpenAI's list of content parts: {"type": "text", "text": ...} and
    # {"type": "image_url", "image_url": {"url": ..., "detail": ...}}.
    content: Union[StrictStr, list[dict[str, Any]], None] = None
    # An assistant's earlier tool calls: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_calls: Optional[list[dict[str, Any]]] = None

    def parts(self, index: int) -> Union[str, list[Union[dict, ImageRef]]]:
        """The content as the library takes it: a string when it holds no image (text parts
        joined), else a list of ``{"type": "text", "text"}`` parts and :class:`ImageRef` s."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts: list[Union[dict, ImageRef]] = []
        for j, part in enumerate(self.content):
            where, param = f"messages[{index}].content[{j}]", f"messages.{index}.content.{j}"
            kind = part.get("type")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}: a text part needs 'text', a string", param=param)
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                image_url = part.get("image_url")
                if isinstance(image_url, str):  # some clients send the URL itself
                    image_url = {"url": image_url}
                if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
                    raise APIError(400, f"{where}: an image_url part needs 'image_url': {{'url': ...}}, its url a "
                                        "string (a data URI: data:image/png;base64,...)", param=param)
                detail = image_url.get("detail")
                if detail is not None and detail not in IMAGE_DETAILS:
                    raise APIError(400, f"{where}: image_url.detail must be one of {', '.join(IMAGE_DETAILS)}, "
                                        f"not {detail!r:.40}", param=param)
                parts.append(ImageRef(image_url["url"], index, j))
            else:
                raise APIError(400, f"{where}: a content part's type must be 'text' or 'image_url', not "
                                    f"{kind!r:.40}", param=param)
        if not any(isinstance(p, ImageRef) for p in parts):
            return "".join(cast(dict, p)["text"] for p in parts)
        return parts

    def text(self, index: int) -> str:
        """The text of the content (its text parts joined)."""
        parts = self.parts(index)
        if isinstance(parts, str):
            return parts
        return "".join(p["text"] for p in parts if isinstance(p, dict))


# OpenAI's role names mapped to the Llama chat formats' ones.
ROLE_NAMES = {"developer": "system", "tool": "ipython"}


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=0)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=0)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[list[dict[str, Any]]] = None
    # "auto" (None), "none", "required" or {"type": "function", "function": {"name": ...}}:
    # checked by llama.structured.check_tool_choice (a 400 naming tool_choice otherwise).
    tool_choice: Any = None
    parallel_tool_calls: StrictBool = True

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def dialog(self) -> list[dict]:
        """The messages as the library's dialog: ``[{"role", "content"[, "tool_calls"]}, ...]``, a
        content with images a list of text parts and :class:`ImageRef` s, which
        :func:`llama.serve.media.resolve_dialog_images` reads."""
        out = []
        for i, m in enumerate(self.messages):
            message: dict = {"role": ROLE_NAMES.get(m.role, m.role), "content": m.parts(i)}
            if m.tool_calls:
                message["tool_calls"] = [_library_tool_call(call, i, k) for k, call in enumerate(m.tool_calls)]
            out.append(message)
        return out


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shapes): a text ``prompt``, or chat ``messages`` put through the
    chat format as ``/v1/chat/completions`` puts them (with ``tools`` and ``tool_choice`` declared
    as there), never both.

    ``add_special_tokens`` (a prompt's BOS) defaults to True for a prompt, as /v1/completions
    encodes it; a chat format writes its special tokens itself (BOS included), so with
    ``messages`` the flag changes nothing.  ``add_generation_prompt`` and
    ``continue_final_message`` are vLLM's; this server's chat formats always end the prompt
    with the assistant's header, so only their defaults (True, False) are taken."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Optional[StrictBool] = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: Optional[StrictBool] = False
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Any = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' (text) or 'messages' (a chat), not " +
                             ("both" if self.prompt is not None else "neither"))
        return self

    def as_chat(self) -> "ChatCompletionRequest":
        """The chat request whose prompt this tokenises (its messages, tools and tool_choice)."""
        return ChatCompletionRequest.model_validate({"messages": self.messages, "tools": self.tools,
                                                     "tool_choice": self.tool_choice})


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape): token ids back to text."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[StrictStr] = None
    tokens: list[StrictInt]


def _library_tool_call(call: dict, i: int, k: int) -> dict:
    """OpenAI's ``{"id", "type": "function", "function": {"name", "arguments": "<JSON>"}}`` as the
    library's ``ToolCall`` (``call_id``, ``tool_name``, ``arguments`` as a dict)."""
    param = f"messages.{i}.tool_calls.{k}"
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{param}: a tool call needs function.name", param=param)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise APIError(400, f"{param}: function.arguments is not valid JSON ({e})", param=param) from None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{param}: function.arguments must be a JSON object", param=param)
    return {"call_id": str(call.get("id") or f"call_{i}_{k}"), "tool_name": function["name"], "arguments": arguments}


def openai_tool_calls(calls: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The library's tool calls in OpenAI's response shape (arguments as a JSON string)."""
    return [{"id": c.get("call_id") or f"call_{k}", "type": "function",
             "function": {"name": c["tool_name"], "arguments": json.dumps(c["arguments"])}}
            for k, c in enumerate(calls)]


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
TokenizeRequest.model_rebuild()


def token_piece(tokenizer: Tokenizer, token: int) -> tuple[str, bytes]:
    """One token's own text and bytes (with its leading space, unlike ``decode([token])``)."""
    if isinstance(tokenizer, TiktokenTokenizer):
        raw = tokenizer.model.decode_single_token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw
    if isinstance(tokenizer, SentencePieceTokenizer):
        piece = tokenizer.sp_model.id_to_piece(token)
        if tokenizer.sp_model.is_byte(token):  # "<0x0A>": a byte-fallback token
            raw = bytes([int(piece[3:5], 16)])
            return raw.decode("utf-8", errors="replace"), raw
        if tokenizer.sp_model.is_control(token) or tokenizer.sp_model.is_unknown(token):
            return "", b""
        text = piece.replace("\u2581", " ")
        return text, text.encode("utf-8")
    text = tokenizer.decode([token])
    return text, text.encode("utf-8")
