"""``POST /v1/completions``: text (or token-id) prompts continued, whole or streamed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, AsyncIterator, Optional, Sequence, Union, cast

from fastapi import Request
from sse_starlette import EventSourceResponse

from llama.engine.detokenize import prompt_text, prompt_text_offsets
from llama.serve import openai_api as oa
from llama.serve.serving import OpenAIServing, finish_reason, kept_events, usage
from llama.serve.streaming import sse
from llama.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llama.engine import RequestResult, TokenEvent

ENDPOINT = "/v1/completions"


async def create_completion(serving: OpenAIServing, req: oa.CompletionRequest,
                            request: Request) -> Union[dict, EventSourceResponse]:
    # Until it is submitted, an idle engine waits for it with the others sent at the same time.
    with serving.engine.arriving():
        lora = serving.check_model(req.model)
        tokenizer = serving.tokenizer
        given = req.prompts()
        serving.check_request(req, len(given) * req.n)
        # null (which the API allows) is as if max_tokens were not given
        max_tokens = oa.DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        for i, p in enumerate(given):  # what can be checked before tokenising
            if isinstance(p, str):
                serving.check_text_length(len(p), "prompt")
            elif not p:
                raise oa.APIError(400, f"prompt {i} is an empty list of token ids", param="prompt")
            else:
                serving.check_context(len(p), max_tokens, "max_tokens")

        def tokenize() -> list[list[int]]:
            return [tokenizer.encode(p, bos=True, eos=False) if isinstance(p, str) else list(p) for p in given]

        prompts = await asyncio.to_thread(tokenize)  # off the event loop: it takes time in proportion to the text
        for tokens in prompts:
            serving.check_context(len(tokens), max_tokens, "max_tokens")
        n = req.n
        n_top = req.logprobs or 0
        want_logprobs = req.logprobs is not None
        if req.echo and req.stream and want_logprobs:
            raise oa.APIError(400, "echo with logprobs is not supported when streaming", param="echo")
        expanded = [tokens for tokens in prompts for _ in range(n)]
        # the first builds the vocabulary view: off the loop
        grammar = None if req.response_format is None else \
            await serving.compiled(lambda: serving.grammar(req, request), request)
        group = serving.submit_all(expanded, lambda i: serving.settings(
            req, request, max_tokens, i % n, logprobs=want_logprobs, top_logprobs=n_top,
            echo=req.echo and want_logprobs, text_follows_prompt=req.echo, grammar=grammar, lora=lora))
    rid, now, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), lora or serving.model_name

    def echo_text(i: int) -> str:
        """What an echo shows of choice ``i``'s prompt, as text_completion(echo=True) does;
        the completion's text continues it (RequestSettings.text_follows_prompt)."""
        return prompt_text(tokenizer, prompts[i // n])

    if req.stream:
        async def chunks() -> AsyncIterator[dict]:
            if req.echo:
                for i in range(len(expanded)):
                    yield completion_chunk(rid, now, model, i, echo_text(i), None)
            async for choice, item in group.items():
                if choice.result is item:
                    yield completion_chunk(rid, now, model, choice.index, "", finish_reason(item))
                    continue
                final = choice.newly_final(cast("TokenEvent", item))  # not the result: a token
                lp = None
                if want_logprobs and final:
                    echoed = len(echo_text(choice.index)) if req.echo else 0
                    lp = completion_logprobs(tokenizer, [ev for ev, _ in final], [echoed + o for _, o in final],
                                             n_top)
                if item.text or lp is not None:
                    yield completion_chunk(rid, now, model, choice.index, item.text, None, lp)

        def usage_chunk() -> dict:
            return {"id": rid, "object": "text_completion", "created": now, "model": model, "choices": [],
                    "usage": usage(group.choices, n)}

        return sse(serving.metrics, ENDPOINT, request, group, chunks(), usage_chunk, req.include_usage)

    choices = await serving.results(group, request)
    body_choices = []
    for c in choices:
        r = cast("RequestResult", c.result)  # serving.results: every choice finished
        prefix = echo_text(c.index) if req.echo else ""
        lp = None
        if want_logprobs:
            prompt = None
            if req.echo and r.prompt_logprobs is not None:
                prompt = (c.prompt_tokens, r.prompt_logprobs, prompt_text_offsets(tokenizer, c.prompt_tokens))
            lp = completion_logprobs(tokenizer, kept_events(c), [len(prefix) + o for o in r.text_offsets], n_top,
                                     prompt)
        body_choices.append({"index": c.index, "text": prefix + r.text, "logprobs": lp,
                             "finish_reason": finish_reason(r)})
    serving.metrics.requests.labels(ENDPOINT, "200").inc()
    request.state.usage = usage(choices, n)
    return {"id": rid, "object": "text_completion", "created": now, "model": model,
            "choices": body_choices, "usage": request.state.usage}


def completion_logprobs(tokenizer: Tokenizer, events: list, offsets: Sequence[int], n_top: int,
                        prompt: Optional[tuple] = None) -> dict:
    """Completions-style logprobs: parallel lists (the prompt's tokens first when echoed,
    ``prompt`` = (tokens, logprobs, offsets)); ``text_offset`` is where each token's text
    starts in the choice's text."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if prompt is not None:
        for i, (tok, lp, offset) in enumerate(zip(*prompt)):
            out["tokens"].append(oa.token_piece(tokenizer, tok)[0])
            out["token_logprobs"].append(None if i == 0 else lp)
            out["top_logprobs"].append(None)
            out["text_offset"].append(offset)
    for ev, offset in zip(events, offsets):
        out["tokens"].append(oa.token_piece(tokenizer, ev.token)[0])
        out["token_logprobs"].append(ev.logprob)
        out["top_logprobs"].append(
            {oa.token_piece(tokenizer, t)[0]: lp for t, lp in (ev.top_logprobs or [])[:n_top]} if n_top else None
        )
        out["text_offset"].append(offset)
    return out


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, finish: Optional[str],
                     logprobs: Optional[dict] = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
