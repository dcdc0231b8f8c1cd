"""``POST /tokenize`` and ``POST /detokenize``, at vLLM's paths and in its shapes.

``/tokenize`` takes ``{"prompt", "add_special_tokens"}`` or ``{"messages",
"add_generation_prompt", "continue_final_message", "tools", "tool_choice"}`` and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` only with
``return_token_strs``, else null).  A prompt is encoded as ``/v1/completions`` encodes it;
messages through the chat format exactly as ``/v1/chat/completions`` puts them
(:func:`~llama.serve.chat.chat_prompt`), so ``count`` is that request's
``usage.prompt_tokens``.  A prompt longer than the context is counted all the same (telling
whether it fits is what clients ask for); the body size limit bounds the work.

``/detokenize`` takes ``{"tokens"}`` and answers ``{"prompt"}``: the ids' text as the
tokenizer decodes them, special tokens written out.  An id outside the vocabulary is a 400.

``token_strs`` are each token's own text (its bytes decoded, a SentencePiece word with its
leading space): vLLM gives the tokenizer's raw pieces ("▁Hello", "ĠHello"), which differ per
tokenizer family; the text is what a client can show.
"""

from __future__ import annotations

import asyncio

from llama.serve import openai_api as oa
from llama.serve.chat import chat_prompt, plan_request
from llama.serve.serving import OpenAIServing


async def tokenize(serving: OpenAIServing, req: oa.TokenizeRequest) -> dict:
    serving.check_model(req.model)
    tokenizer = serving.tokenizer
    if req.prompt is not None:
        bos = True if req.add_special_tokens is None else req.add_special_tokens
        text = req.prompt
        tokens = await asyncio.to_thread(lambda: tokenizer.encode(text, bos=bos, eos=False))
    else:
        if req.continue_final_message:
            raise oa.APIError(400, "continue_final_message is not supported: this server's chat formats end the "
                                   "prompt with the assistant's header (a new reply); leave it false",
                              param="continue_final_message")
        if not req.add_generation_prompt:
            raise oa.APIError(400, "add_generation_prompt=false is not supported: this server's chat formats end the "
                                   "prompt with the assistant's header, as a chat request's prompt; leave it true",
                              param="add_generation_prompt")
        try:
            chat = req.as_chat()
        except ValueError as e:  # pydantic's ValidationError
            raise oa.APIError(400, str(e), param="messages") from None
        tokens = (await chat_prompt(serving, chat.dialog(), plan_request(chat))).tokens
    strs = [token_str(serving, t) for t in tokens] if req.return_token_strs else None
    serving.metrics.requests.labels("/tokenize", "200").inc()
    return {"count": len(tokens), "max_model_len": serving.engine.max_seq_len, "tokens": tokens, "token_strs": strs}


async def detokenize(serving: OpenAIServing, req: oa.DetokenizeRequest) -> dict:
    serving.check_model(req.model)
    n_words = serving.tokenizer.n_words
    bad = [t for t in req.tokens if not 0 <= t < n_words]
    if bad:
        raise oa.APIError(400, f"tokens: {len(bad)} id(s) outside the vocabulary [0, {n_words}) (the first: "
                               f"{bad[0]}); send ids this model's tokenizer gives", param="tokens",
                          code="invalid_token_id")
    text = await asyncio.to_thread(serving.tokenizer.decode, req.tokens)
    serving.metrics.requests.labels("/detokenize", "200").inc()
    return {"prompt": text}


def token_str(serving: OpenAIServing, token: int) -> str:
    """One token's own text; a Llama 3.2 Vision prompt's ``<|image|>`` (an id past the tokenizer's) by its name."""
    if not 0 <= token < serving.tokenizer.n_words:
        return "<|image|>"
    return oa.token_piece(serving.tokenizer, token)[0]
