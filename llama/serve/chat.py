"""``POST /v1/chat/completions``: a dialog through the model's chat format, the reply whole or
streamed, tool calls read from its token ids.

What the request's ``tools``, ``tool_choice`` and ``response_format`` decide (which tools are
declared, which the reply may call, whether it is constrained to calls) is the Python API's
rule too: :mod:`llama.formats.chat_request` plans both.

A streamed reply takes one of three modes, chosen once per request from its plan
(:func:`reply_streams`), each a unit of its own:

* :class:`TextStream`: a reply that is text, each piece as it is decoded (with its
  log-probabilities when asked);
* :class:`CallStream`: ``tool_choice`` "required" or a named function constrains the reply
  to calls (a grammar, :mod:`llama.structured.tool_choice`), streamed as OpenAI's tool-call
  deltas as the model writes them;
* :class:`AutoStream`: under "auto" a reply may be calls or text, which only its end tells:
  its text is streamed as far as no ending can take it back
  (:class:`~llama.formats.tool_call_stream.AutoReplyContent`: a plain answer as it is
  written), its calls and the rest at its end.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, AsyncIterator, Collection, Optional, Protocol, Sequence, Union, cast

from fastapi import Request
from sse_starlette import EventSourceResponse

from llama.formats.chat_request import ChatRequestPlan, assistant_reply, plan_chat_request
from llama.formats.dialog import Message
from llama.formats.tool_call_stream import AutoReplyContent, ToolCallDeltas
from llama.formats.tool_calls import ToolPromptFormat
from llama.images.prompt import EncodedDialog
from llama.serve import openai_api as oa
from llama.serve.media import resolve_dialog_images
from llama.serve.serving import OpenAIServing, finish_reason, kept_events, usage
from llama.serve.streaming import sse
from llama.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llama.engine import RequestResult, TokenEvent
    from llama.formats.chat import ChatFormat
    from llama.serve.requests import Choice

ENDPOINT = "/v1/chat/completions"
logger = logging.getLogger(__name__)


async def create_chat_completion(serving: OpenAIServing, req: oa.ChatCompletionRequest, request: Request, *,
                                 endpoint: str = ENDPOINT) -> Union[dict, EventSourceResponse]:
    """The chat completion (a dict, or a stream of chunks); ``endpoint``: the path the metrics
    count it under (``/v1/responses`` answers through this one)."""
    # Until it is submitted, an idle engine waits for it with the others sent at the same time.
    with serving.engine.arriving():
        lora = serving.check_model(req.model)
        serving.check_request(req, req.n)
        plan = plan_request(req)
        formatter = serving.formatter
        dialog = req.dialog()
        # the built-in tools a system message declares in Meta's format may be called too
        plan = plan.with_system_tools(cast(list[Message], dialog))
        serving.check_text_length(sum(text_chars(m["content"]) for m in dialog), "messages")
        encoded = await chat_prompt(serving, dialog, plan)
        prompt, images = encoded.tokens, encoded.images
        limit = req.token_limit()
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_seq_len = serving.engine.max_seq_len
        if limit is None:
            if len(prompt) >= max_seq_len:
                serving.check_context(len(prompt), 1, param)
            limit = max_seq_len - len(prompt)
        serving.check_context(len(prompt), limit, param)
        n = req.n
        n_top = req.top_logprobs or 0
        # The chat format's end-of-reply tokens (<|eot_id|>, <|eom_id|> after a tool call, ...).
        reply_ends = getattr(formatter, "stop_tokens", None)
        # The first builds the vocabulary view, and a schema may take a while: off the loop.
        if plan.reply_is_calls:
            grammar = await serving.compiled(lambda: serving.tool_grammar(req, request), request)
        elif req.response_format is not None:
            grammar = await serving.compiled(lambda: serving.grammar(req, request), request)
        else:
            grammar = None
        group = serving.submit_all([prompt] * n, lambda i: serving.settings(
            req, request, limit, i, logprobs=req.logprobs, top_logprobs=n_top, echo=False, stop_tokens=reply_ends,
            grammar=grammar, lora=lora), images=images)
    rid, now, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), lora or serving.model_name
    tokenizer = serving.tokenizer

    if req.stream:
        def chunk(index: int, delta: dict, finish: Optional[str], logprobs: Optional[dict] = None) -> dict:
            body = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if req.include_usage:
                body["usage"] = None
            return body

        streams = reply_streams(plan, n, formatter, tokenizer, serving.tool_prompt_format,
                                logprobs=bool(req.logprobs), top_logprobs=n_top > 0)

        async def chunks() -> AsyncIterator[dict]:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""}, None)
            async for c, item in group.items():
                stream = streams[c.index]
                if c.result is item:
                    delta, finish = stream.end(item)
                    if delta:
                        yield chunk(c.index, delta, None)
                    yield chunk(c.index, {}, finish)
                else:
                    piece = stream.token(c, cast("TokenEvent", item))  # not the result: a token
                    if piece is not None:
                        yield chunk(c.index, piece[0], None, piece[1])

        def usage_chunk() -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model,
                    "choices": [], "usage": usage(group.choices, n)}

        return sse(serving.metrics, endpoint, request, group, chunks(), usage_chunk, req.include_usage)

    choices = await serving.results(group, request)
    body_choices = []
    for c in choices:
        lp = {"content": logprob_entries(tokenizer, kept_events(c), n_top > 0)} if req.logprobs else None
        result = cast("RequestResult", c.result)  # serving.results: every choice finished
        message, finish = openai_reply(formatter, result, plan.callable_tools)
        if plan.reply_is_calls and not message.get("tool_calls"):
            message = cut_calls(result, serving.tool_prompt_format) or message
        body_choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish})
    serving.metrics.requests.labels(endpoint, "200").inc()
    request.state.usage = usage(choices, n)
    return {"id": rid, "object": "chat.completion", "created": now, "model": model,
            "choices": body_choices, "usage": request.state.usage}


async def chat_prompt(serving: OpenAIServing, dialog: list[dict], plan: ChatRequestPlan) -> EncodedDialog:
    """The prompt tokens and images of a chat request's ``dialog``
    (:meth:`~llama.serve.openai_api.ChatCompletionRequest.dialog`) with the tools its ``plan``
    declares: its images read, checked and decoded once, the dialog through the model's chat
    format (off the event loop: both take time in proportion); a 400 naming ``messages`` where
    the format refuses the dialog.  ``/tokenize`` counts the same tokens."""
    formatter = serving.formatter
    if any(isinstance(m["content"], list) for m in dialog):
        dialog = await asyncio.to_thread(resolve_dialog_images, dialog, serving.media,
                                         takes_images=formatter.image_layout is not None,
                                         why_not=formatter.why_no_images())
    try:
        return await asyncio.to_thread(encode_chat, formatter, dialog, plan.tools, serving.tool_prompt_format)
    except (TypeError, ValueError) as e:
        raise oa.APIError(400, str(e), param="messages") from None


def plan_request(req: oa.ChatCompletionRequest) -> ChatRequestPlan:
    """The request's plan (:func:`~llama.formats.chat_request.plan_chat_request`: its tools,
    ``tool_choice`` and ``response_format`` together), or a 400 naming the field at fault."""
    try:
        return plan_chat_request(req.tool_choice, req.tools, req.response_format)
    except (TypeError, ValueError) as e:
        param = "tools" if str(e).startswith("tools") else "tool_choice"
        raise oa.APIError(400, str(e), param=param) from None


# -- a streamed reply: one of three modes, chosen once per request ------------------------


class ReplyStream(Protocol):
    """One choice of a streamed chat reply, turned into OpenAI's deltas as its tokens come."""

    def token(self, choice: Choice, event: TokenEvent) -> Optional[tuple[dict, Optional[dict]]]:
        """The delta (and its ``logprobs``, or None) that a token event sends; None: nothing yet."""
        ...

    def end(self, result: RequestResult) -> tuple[dict, str]:
        """The last delta of the finished reply (empty: none) and its ``finish_reason``."""
        ...


def reply_streams(plan: ChatRequestPlan, n: int, formatter: ChatFormat, tokenizer: Tokenizer,
                  tool_prompt_format: ToolPromptFormat, *, logprobs: bool, top_logprobs: bool) -> list[ReplyStream]:
    """The ``n`` choices' streams, all in the mode the request's plan calls for: calls as they
    are written (:class:`CallStream`, a reply constrained to calls), text or calls told at the
    end (:class:`AutoStream`, "auto" with tools to call), or text (:class:`TextStream`)."""
    if plan.reply_is_calls:
        return [CallStream(formatter, plan.callable_tools, tool_prompt_format) for _ in range(n)]
    if plan.reply_may_call:
        return [AutoStream(formatter, plan.callable_tools, plan.query_tools) for _ in range(n)]
    return [TextStream(tokenizer, logprobs, top_logprobs) for _ in range(n)]


class TextStream:
    """A reply that is text: each piece as it is decoded, with the log-probabilities of the
    tokens that became final (``logprobs``; ``top_logprobs``: with their alternatives)."""

    def __init__(self, tokenizer: Tokenizer, logprobs: bool, top_logprobs: bool) -> None:
        self.tokenizer, self.logprobs, self.top_logprobs = tokenizer, logprobs, top_logprobs

    def token(self, choice: Choice, event: TokenEvent) -> Optional[tuple[dict, Optional[dict]]]:
        final = choice.newly_final(event)
        lp = ({"content": logprob_entries(self.tokenizer, [ev for ev, _ in final], self.top_logprobs)}
              if self.logprobs and final else None)
        return ({"content": event.text}, lp) if event.text or lp is not None else None

    def end(self, result: RequestResult) -> tuple[dict, str]:
        return {}, finish_reason(result)


class CallStream:
    """A reply constrained to calls ("required" or a named function): OpenAI's tool-call deltas
    as the model writes the calls (:class:`~llama.formats.tool_call_stream.ToolCallDeltas`),
    what is left of them at the end (:func:`rest_of_calls`)."""

    def __init__(self, formatter: ChatFormat, tools: Collection[str], tool_prompt_format: ToolPromptFormat) -> None:
        self.formatter, self.tools = formatter, tools
        self.reader = ToolCallDeltas(tool_prompt_format)
        self.text = ""

    def token(self, choice: Choice, event: TokenEvent) -> Optional[tuple[dict, Optional[dict]]]:
        self.text += event.text
        deltas = self.reader.feed(self.text)
        return ({"tool_calls": deltas}, None) if deltas else None

    def end(self, result: RequestResult) -> tuple[dict, str]:
        return rest_of_calls(self.formatter, result, self.tools, self.reader)


class AutoStream:
    """A reply under "auto" that may be calls or text, which only its end tells: the text no
    ending can take back is sent as it comes
    (:class:`~llama.formats.tool_call_stream.AutoReplyContent`), the calls and the rest of the
    content when the reply is read whole at its end."""

    def __init__(self, formatter: ChatFormat, tools: Collection[str], query_tools: Collection[str]) -> None:
        self.formatter, self.tools = formatter, tools
        self.content = AutoReplyContent(query_tools)
        self.text, self.sent = "", 0

    def token(self, choice: Choice, event: TokenEvent) -> Optional[tuple[dict, Optional[dict]]]:
        self.text += event.text
        upto = self.content.sendable(self.text)
        if upto <= self.sent:
            return None
        delta = {"content": self.text[self.sent:upto]}
        self.sent = upto
        return delta, None

    def end(self, result: RequestResult) -> tuple[dict, str]:
        message, finish = openai_reply(self.formatter, result, self.tools)
        delta = {k: v for k, v in message.items() if k != "role" and v}
        head = self.text[:self.sent]
        content = message.get("content") or ""
        if not content.startswith(head):  # AutoReplyContent rules this out
            logger.warning("streamed content is not the start of the reply's content")
            delta.pop("content", None)
        elif content[len(head):]:
            delta["content"] = content[len(head):]
        else:
            delta.pop("content", None)
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": k, **t} for k, t in enumerate(delta["tool_calls"])]
        return delta, finish


def rest_of_calls(formatter: ChatFormat, result: RequestResult, tools: Collection[str],
                  reader: ToolCallDeltas) -> tuple[dict, str]:
    """The last delta of a reply whose calls were streamed as written, and its finish_reason:
    what the calls read from the whole reply hold beyond what was streamed.  A reply that
    holds no call (cut by max_tokens) finishes as it is: with the text not yet sent as
    content if no call was announced, with nothing more if one was."""
    calls = assistant_reply(formatter, result, tools)["tool_calls"]
    if calls:
        rest = reader.finish(calls)
        return ({"tool_calls": rest} if rest else {}), "tool_calls"
    if reader.calls or not result.text:
        return {}, finish_reason(result)
    return {"content": result.text}, finish_reason(result)


def cut_calls(result: RequestResult, tool_prompt_format: ToolPromptFormat) -> Optional[dict]:
    """The message of a reply constrained to calls that ended before its calls did (cut by
    max_tokens), as its stream tells it: the calls announced before the cut, each with the
    arguments completed before it (OpenAI's cut call: finish_reason "length", arguments that may
    be unfinished JSON); None if no call was announced (the reply is then its text)."""
    reader = ToolCallDeltas(tool_prompt_format)
    reader.feed(result.text)
    calls = reader.written()
    return {"role": "assistant", "content": None, "tool_calls": calls} if calls else None


def encode_chat(formatter: ChatFormat, dialog: list[dict], tools: Optional[Sequence[object]],
                tool_prompt_format: Optional[ToolPromptFormat] = None) -> EncodedDialog:
    """A chat request's prompt tokens and images, through the model's chat format (which declares
    the OpenAI-shaped ``tools`` for Llama 3.1+, in ``tool_prompt_format``, and refuses them for
    older formats)."""
    messages = cast(list[Message], dialog)  # the request model's messages, checked again by the format
    if tools:
        try:
            return formatter.encode_dialog(messages, tool_prompt_format, tools=tools)
        except (TypeError, ValueError) as e:
            raise oa.APIError(400, str(e), param="tools") from None
    return formatter.encode_dialog(messages, tool_prompt_format)  # earlier calls written back in it


def text_chars(content: object) -> int:
    """The characters of a message's text (its text parts' when it holds images)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def openai_reply(formatter: ChatFormat, result: RequestResult, tools: Collection[str]) -> tuple[dict, str]:
    """The response message and finish_reason of a chat result.  Tool calls are read from the
    reply's token ids (:func:`llama.formats.chat_request.assistant_reply`): only calls of the request's
    ``tools`` make ``tool_calls`` (finish_reason ``"tool_calls"``); a reply cut by max_tokens is
    ``"length"`` with its text as content."""
    if not tools:
        return {"role": "assistant", "content": result.text}, finish_reason(result)
    message = assistant_reply(formatter, result, tools)
    if not message["tool_calls"]:
        return {"role": "assistant", "content": message["content"]}, finish_reason(result)
    return ({"role": "assistant", "content": message["content"] or None,
             "tool_calls": oa.openai_tool_calls(message["tool_calls"])}, "tool_calls")


def logprob_entries(tokenizer: Tokenizer, events: list, with_top: bool) -> list[dict]:
    """Chat-style logprobs: one entry per generated token."""
    entries = []
    for ev in events:
        text, raw = oa.token_piece(tokenizer, ev.token)
        entry = {"token": text, "logprob": ev.logprob, "bytes": list(raw), "top_logprobs": []}
        if with_top and ev.top_logprobs:
            for tok, lp in ev.top_logprobs:
                t, b = oa.token_piece(tokenizer, tok)
                entry["top_logprobs"].append({"token": t, "logprob": lp, "bytes": list(b)})
        entries.append(entry)
    return entries
