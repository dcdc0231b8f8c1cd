"""``POST /v1/chat/completions``: a dialog through the model's chat format, the reply whole or
streamed, tool calls read from its token ids.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, AsyncIterator, Collection, Optional, Union

from fastapi import Request
from sse_starlette import EventSourceResponse

from llama.formats.tool_prompts import declared_tool_names
from llama.serve import openai_api as oa
from llama.serve.serving import OpenAIServing, finish_reason, kept_events, usage
from llama.serve.streaming import sse
from llama.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llama.engine import RequestResult
    from llama.formats.chat import ChatFormat

ENDPOINT = "/v1/chat/completions"


async def create_chat_completion(serving: OpenAIServing, req: oa.ChatCompletionRequest,
                                 request: Request) -> Union[dict, EventSourceResponse]:
    serving.check_model(req.model)
    serving.check_request(req, req.n)
    check_tool_choice(req)
    formatter = serving.formatter
    dialog = req.dialog()
    serving.check_text_length(sum(len(m["content"]) for m in dialog), "messages")
    try:  # off the event loop: it takes time in proportion to the text
        prompt = await asyncio.to_thread(encode_chat, formatter, dialog, req.tools)
    except (TypeError, ValueError) as e:
        raise oa.APIError(400, str(e), param="messages") from None
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
    grammar = await asyncio.to_thread(serving.grammar, req)  # the first builds the vocabulary view: off the loop
    group = serving.submit_all([prompt] * n, lambda i: serving.settings(
        req, request, limit, i, logprobs=req.logprobs, top_logprobs=n_top, echo=False, stop_tokens=reply_ends,
        grammar=grammar))
    parse_tools = bool(req.tools) and grammar is None  # a constrained reply is content
    declared = declared_tool_names(req.tools) if grammar is None else ()
    rid, now, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), serving.model_name
    tokenizer = serving.tokenizer

    if req.stream:
        def chunk(index: int, delta: dict, finish: Optional[str], logprobs: Optional[dict] = None) -> dict:
            body = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if req.include_usage:
                body["usage"] = None
            return body

        async def chunks() -> AsyncIterator[dict]:
            for i in range(n):
                yield chunk(i, {"role": "assistant", "content": ""}, None)
            async for choice, item in group.items():
                if choice.result is item:
                    if parse_tools:  # the reply was held back: it may be a tool call
                        message, finish = openai_reply(formatter, item, declared)
                        delta = {k: v for k, v in message.items() if k != "role" and v}
                        if "tool_calls" in delta:
                            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(delta["tool_calls"])]
                        if delta:
                            yield chunk(choice.index, delta, None)
                    else:
                        finish = finish_reason(item)
                    yield chunk(choice.index, {}, finish)
                elif not parse_tools:
                    final = choice.newly_final(item)
                    lp = ({"content": logprob_entries(tokenizer, [ev for ev, _ in final], n_top > 0)}
                          if req.logprobs and final else None)
                    if item.text or lp is not None:
                        yield chunk(choice.index, {"content": item.text}, None, lp)

        def usage_chunk() -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model,
                    "choices": [], "usage": usage(group.choices, n)}

        return sse(serving.metrics, ENDPOINT, request, group, chunks(), usage_chunk, req.include_usage)

    choices = await serving.results(group, request)
    body_choices = []
    for c in choices:
        lp = {"content": logprob_entries(tokenizer, kept_events(c), n_top > 0)} if req.logprobs else None
        message, finish = openai_reply(formatter, c.result, declared)
        body_choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish})
    serving.metrics.requests.labels(ENDPOINT, "200").inc()
    request.state.usage = usage(choices, n)
    return {"id": rid, "object": "chat.completion", "created": now, "model": model,
            "choices": body_choices, "usage": request.state.usage}


def check_tool_choice(req: oa.ChatCompletionRequest) -> None:
    """``tool_choice``: the model always chooses for itself, so only ``"auto"`` (the default)
    is honoured, and ``"none"`` where no tools are declared (then nothing can be called).
    Anything else (``"required"``, a named function, ``"none"`` beside tools) is a 400 rather
    than silently ignored."""
    choice = req.tool_choice
    if choice is None or choice == "auto" or (choice == "none" and not req.tools):
        return
    if choice == "none":
        message = ("tool_choice 'none' with tools is not supported yet: the model would still see the tools; "
                   "send the request without tools so that none can be called")
    else:
        message = (f"tool_choice {json.dumps(choice)[:200]} is not supported yet: this server lets the model "
                   "choose whether to call a tool ('auto', the default)")
    raise oa.APIError(400, message, param="tool_choice")


def encode_chat(formatter: ChatFormat, dialog: list[dict], tools: Optional[list[dict]]) -> list[int]:
    """A chat request's prompt tokens, through the model's chat format (which declares the
    OpenAI-shaped ``tools`` for Llama 3.1+ and refuses them for older formats)."""
    if tools:
        try:
            return formatter.encode_dialog_prompt(dialog, tools=tools)
        except (TypeError, ValueError) as e:
            raise oa.APIError(400, str(e), param="tools") from None
    return formatter.encode_dialog_prompt(dialog)


def openai_reply(formatter: ChatFormat, result: RequestResult, tools: Collection[str]) -> tuple[dict, str]:
    """The response message and finish_reason of a chat result.  Tool calls are read from the
    reply's token ids (:func:`llama.generation.assistant_reply`): only calls of the request's
    ``tools`` make ``tool_calls`` (finish_reason ``"tool_calls"``); a reply cut by max_tokens is
    ``"length"`` with its text as content."""
    if not tools:
        return {"role": "assistant", "content": result.text}, finish_reason(result)
    from llama.generation import assistant_reply

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
