"""Llama 3.2 Vision through the engine: each request's image context (its images'
cross-attention K/V) computed at prefill, held for the request's life, used at every later step
and let go when it ends, against a second implementation: the model called directly
(``Transformer.image_context`` then ``forward`` with its own cache, as the model piece's parity
tests call it, which match transformers' ``MllamaForConditionalGeneration``), and transformers
itself for one prompt.

The model: mllama_helpers' tiny random ``MllamaForConditionalGeneration`` (28-pixel tiles, up to
4 an image) with Llama 3's vocabulary (128,256 ids; ``<|image|>`` is 128256) and Llama 3's
tokenizer, converted with ``hf_to_meta`` and read by ``Llama.build``, so that its chat format
lays out Meta's Llama 3.2 vision prompts."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mllama_helpers as mh
from llama import Llama
from llama.engine import RequestSettings
from llama.engine.build import assemble_engine
from llama.images.mllama import stack_images
from llama.images.prompt import MLLAMA_IMAGE_TOKEN_ID, MllamaPromptImage

transformers = pytest.importorskip("transformers")
pytest.importorskip("llama_models")
Image = pytest.importorskip("PIL.Image")

pytestmark = pytest.mark.slow  # every test here loads the model (a module fixture)

VOCAB = mh.LLAMA3_VOCAB  # Llama 3's: <|image|> is the first learnt row after it
GREEDY = dict(temperature=0.0, stop_tokens=frozenset())  # every token counts: none ends a request


@pytest.fixture(scope="module")
def vision_files(mllama_llama3_files):
    """(transformers' model, the folder it is saved in, with Llama 3's tokenizer, under ``hf``,
    and its conversion under ``meta``): conftest's, shared with tests/test_mllama_serve.py."""
    return mllama_llama3_files


@pytest.fixture(scope="module")
def vision(vision_files):
    """(transformers' model, our Llama built from its conversion with Llama 3's tokenizer)."""
    hf, root = vision_files
    llama = Llama.build(root / "meta", max_seq_len=160, max_batch_size=4, device="cpu", dtype="float32")
    assert llama.model.image_token_id == MLLAMA_IMAGE_TOKEN_ID
    return hf, llama


def engine_of(llama: Llama, **options) -> Llama:
    """Another engine over the same model (its own KV cache, prefix cache and image contexts)."""
    return Llama._holding(assemble_engine(llama.model, llama.tokenizer, kv_block_size=8, **options))


def picture(color: tuple[int, int, int], size: tuple[int, int] = (28, 28)) -> bytes:
    """A PNG with a pattern, so that its tiles differ."""
    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 3):
        for y in range(0, size[1], 3):
            image.putpixel((x, y), ((x * 5) % 256, (y * 7) % 256, (x + y) % 256))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def image(data: bytes) -> dict:
    return {"type": "image", "image": data}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


RED, GREEN, BLUE = picture((200, 30, 30)), picture((30, 200, 30), (60, 28)), picture((30, 30, 200), (28, 60))
DIALOGS = {
    "image at the start": [{"role": "user", "content": [image(RED), text("What is in the picture?")]}],
    "image mid-dialog": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": [text("What is in"), image(GREEN), text("?")]}],
    "two images": [
        {"role": "user", "content": [image(BLUE), text("What is this?")]},
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": [text("And this?"), image(RED)]}],
}


def encode(llama: Llama, messages: list[dict]) -> tuple[list[int], list[MllamaPromptImage]]:
    encoded = llama.formatter.encode_dialog(messages)
    return encoded.tokens, encoded.images


def reference_greedy(llama: Llama, tokens: list[int], images: list[MllamaPromptImage], n: int) -> list[int]:
    """``n`` greedy tokens from the model called directly: one image context, then ``forward``
    over the prompt and one token at a time with the model's own cache."""
    model = llama.model
    t = torch.tensor([tokens])
    context = None
    if images:
        batch = stack_images([images])
        context = model.image_context(batch.pixel_values, batch.aspect_ratio_ids, t)
    logits = model.forward(t, 0, images=context)
    out = [int(logits[0, -1].argmax())]
    for step in range(n - 1):
        logits = model.forward(torch.tensor([[out[-1]]]), len(tokens) + step, images=context)
        out.append(int(logits[0, -1].argmax()))
    return out


def hf_greedy(hf, tokens: list[int], images: list[MllamaPromptImage], n: int) -> list[int]:
    """transformers' greedy tokens for the same tensors (Meta's rule for text before an image)."""
    batch = stack_images([images])
    canvases = [img.grid for img in images]
    cross_mask, aspect_mask = mh.hf_masks([mh.IMAGE if t == VOCAB else t for t in tokens], canvases)
    t = torch.tensor([tokens])
    with torch.no_grad(), mh.meta_row_masking():
        out = hf.generate(input_ids=t, attention_mask=torch.ones_like(t), pixel_values=batch.pixel_values,
                          aspect_ratio_ids=batch.aspect_ratio_ids, aspect_ratio_mask=aspect_mask,
                          cross_attention_mask=cross_mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(tokens):].tolist()


def run(llama: Llama, tokens: list[int], images: list[MllamaPromptImage], n: int, **settings):
    return llama.engine.submit(tokens, RequestSettings(max_new_tokens=n, **{**GREEDY, **settings}),
                               images=images).result()


@pytest.mark.parametrize("name", list(DIALOGS))
def test_engine_greedy_tokens_are_the_models(vision, name):
    """An image at the start, mid-dialog, two images: the engine's greedy tokens are the model's
    called directly; its context is let go when the request ends."""
    _, llama = vision
    tokens, images = encode(llama, DIALOGS[name])
    assert tokens.count(MLLAMA_IMAGE_TOKEN_ID) == len(images) == (2 if name == "two images" else 1)
    expected = reference_greedy(llama, tokens, images, 8)
    engine = engine_of(llama)
    assert run(engine, tokens, images, 8).tokens == expected
    assert len(engine.engine.image_contexts) == 0
    # the images are used: the same prompt with other pictures continues otherwise
    other = [MllamaPromptImage(torch.randn_like(i.pixel_values) * (i.pixel_values != 0), i.grid, i.start, i.end,
                               i.attended_until) for i in images]
    assert reference_greedy(llama, tokens, other, 8) != expected


def test_the_reference_is_transformers(vision):
    """The model-direct reference is transformers' greedy decoding for the same tensors."""
    hf, llama = vision
    tokens, images = encode(llama, DIALOGS["two images"])
    assert hf_greedy(hf, tokens, images, 6) == reference_greedy(llama, tokens, images, 6)


def test_a_text_request_beside_an_image_request_is_unchanged(vision):
    """Batched together (and with prompt chunks that cut the prompts), a text-only request's
    tokens are those it gets alone, and the image requests' (one image, two: rows of different
    numbers of vision tokens) the model's."""
    _, llama = vision
    engine = engine_of(llama, prefill_chunk=16)
    prompts = [encode(llama, DIALOGS["image mid-dialog"]), encode(llama, DIALOGS["two images"])]
    plain = encode(llama, [{"role": "user", "content": "Tell me about the sea."}])[0]
    alone = run(engine_of(llama), plain, [], 10).tokens
    assert alone == reference_greedy(llama, plain, [], 10)
    settings = RequestSettings(max_new_tokens=10, **GREEDY)  # type: ignore[arg-type]
    handles = [engine.engine.submit(tokens, settings, images=images) for tokens, images in prompts]
    handles.append(engine.engine.submit(plain, settings))
    *with_images, text_only = [h.result() for h in handles]
    assert text_only.tokens == alone
    for (tokens, images), result in zip(prompts, with_images):
        assert result.tokens == reference_greedy(llama, tokens, images, 10)
    assert len(engine.engine.image_contexts) == 0


def test_contexts_are_held_for_the_life_and_let_go_on_abort(vision):
    """While a request runs its context is held (computed once); cancelled, it is let go."""
    _, llama = vision
    engine = engine_of(llama).engine
    tokens, images = encode(llama, DIALOGS["image at the start"])
    computed = []
    real = llama.model.image_context

    def counting(*args, **kwargs):
        computed.append(1)
        return real(*args, **kwargs)

    llama.model.image_context = counting  # type: ignore[method-assign]
    try:
        handle = engine.submit(tokens, RequestSettings(max_new_tokens=50, **GREEDY),  # type: ignore[arg-type]
                               images=images)
        for _ in range(4):  # prefill, then decoding steps
            engine.step()
        assert len(engine.image_contexts) == 1 and engine.image_contexts.bytes_held() > 0
        handle.cancel()
        while engine.scheduler.has_work:
            engine.step()
        assert handle.result().finish_reason == "cancelled"
    finally:
        del llama.model.image_context
    assert computed == [1]
    assert len(engine.image_contexts) == 0


def test_preempted_requests_with_images_give_their_tokens(vision):
    """Four image requests in a pool too small for them all: requests are preempted and resumed,
    their contexts let go and computed again; each gets the model's tokens."""
    _, llama = vision
    engine = engine_of(llama, prefill_chunk=16, kv_cache_tokens=160)
    prompts = [encode(llama, [{"role": "user", "content": [image(picture((60 * k, 20, 200 - 40 * k))),
                                                            text(f"Picture {k}?")]}]) for k in range(4)]
    settings = RequestSettings(max_new_tokens=40, **GREEDY)  # type: ignore[arg-type]
    computed: list[int] = []
    real = llama.model.image_context

    def counting(*args, **kwargs):
        computed.append(1)
        return real(*args, **kwargs)

    llama.model.image_context = counting  # type: ignore[method-assign]
    try:
        handles = [engine.engine.submit(t, settings, images=i) for t, i in prompts]
        results = [h.result() for h in handles]
    finally:
        del llama.model.image_context
    preemptions = engine.engine.stats()["preemptions_total"]
    assert preemptions > 0
    assert len(computed) == len(prompts) + preemptions  # each preempted request's context computed again
    for (tokens, images), result in zip(prompts, results):
        assert result.tokens == reference_greedy(llama, tokens, images, 40)
    assert len(engine.engine.image_contexts) == 0


def test_chat_completion_sees_the_image(vision):
    """Llama.chat_completion with an image part: the reference's greedy tokens; the stream's text
    is the same reply."""
    _, llama = vision
    messages = DIALOGS["image at the start"]
    (reply,) = llama.chat_completion([messages], temperature=0.0, max_gen_len=6, logprobs=True)
    tokens, images = encode(llama, messages)
    expected = reference_greedy(llama, tokens, images, 6)
    assert reply["tokens"] == [llama.tokenizer.decode([t]) for t in expected[: len(reply["tokens"])]]
    stream = llama.chat_completion_stream(messages, temperature=0.0, max_gen_len=6)
    assert "".join(stream) == reply["generation"]["content"]


def test_bad_image_prompts_are_refused(vision):
    """An image without its <|image|> token, a token without its image, tiles of another size."""
    _, llama = vision
    engine = llama.engine
    tokens, images = encode(llama, DIALOGS["two images"])
    settings = RequestSettings(max_new_tokens=1)
    with pytest.raises(ValueError, match="2 <.image.> token"):
        engine.submit(tokens, settings, images=images[:1])
    with pytest.raises(ValueError, match="2 <.image.> token"):
        engine.submit(tokens, settings)
    moved = [MllamaPromptImage(i.pixel_values, i.grid, i.start + 1, i.end + 1, i.attended_until) for i in images]
    with pytest.raises(ValueError, match="no <.image.> token"):
        engine.submit(tokens, settings, images=moved)
    small = [MllamaPromptImage(i.pixel_values[:, :, :14, :14], i.grid, i.start, i.end, i.attended_until)
             for i in images]
    with pytest.raises(ValueError, match="this model's tiles"):
        engine.submit(tokens, settings, images=small)


# -- the image pool's accounting ---------------------------------------------------------------

def books_straight(engine) -> None:
    """Held contexts belong to running requests with images; the image slots in use are within
    the pool, and so are the K/V held and a step's batched copy of them (the memory check counts
    the pool's size for each: one image of the largest canvas a slot); the block pool's books balance."""
    from llama.checkpoint.memory import image_kv_bytes

    running = engine.scheduler.running
    contexts = engine.image_contexts
    assert contexts.request_ids() <= {i for i, r in running.items() if r.images}
    assert engine.scheduler.image_slots_used() <= contexts.capacity
    pool = image_kv_bytes(engine.model, contexts.capacity, torch.float32)
    assert contexts.bytes_held() <= pool and contexts.bytes_batched() <= pool
    engine.kv.blocks.check([engine.kv.block_ids(r) for r in running])


def all_back(engine) -> None:
    """Nothing runs, no context is held, every block is free or cached."""
    assert not engine.scheduler.running and not engine.scheduler.preempted
    assert len(engine.image_contexts) == 0 and engine.image_contexts.bytes_held() == 0
    assert engine.scheduler.image_slots_used() == 0
    engine.kv.blocks.check([])
    assert engine.kv.blocks.available == engine.kv.blocks.usable


def test_requests_wait_for_image_slots(vision):
    """The pool holds max_batch_size (4) images: three requests of two images each never run
    together (the third waits with a row free), and each gets the model's tokens.  A 2-image
    request and 1-image ones: at most two run together (2 rows x 2 images: a step's batched
    copy is as wide as the widest row), though three hold only 4 images; a text request runs
    beside them (its row has no copy)."""
    _, llama = vision
    engine = engine_of(llama).engine
    assert engine.image_contexts.capacity == 4
    tokens, images = encode(llama, DIALOGS["two images"])
    one_tokens, one_image = encode(llama, DIALOGS["image at the start"])
    plain = encode(llama, [{"role": "user", "content": "Tell me about the sea."}])[0]
    settings = RequestSettings(max_new_tokens=6, **GREEDY)  # type: ignore[arg-type]
    mixed = [(tokens, images), (one_tokens, one_image), (one_tokens, one_image), (plain, [])]
    for prompts in ([(tokens, images)] * 3, mixed):
        handles = [engine.submit(t, settings, images=i) for t, i in prompts]
        most = 0
        while not all(h.finished for h in handles):
            engine.step()
            books_straight(engine)
            most = max(most, len([r for r in engine.scheduler.running.values() if r.images]))
        assert most == 2
        for (t, i), h in zip(prompts, handles):
            assert h.result().tokens == reference_greedy(llama, t, i, 6)
        all_back(engine)


def test_more_images_than_the_pool_holds_are_refused(vision):
    _, llama = vision
    messages = [{"role": "user", "content": [image(RED)] * 5 + [text("Five?")]}]
    tokens, images = encode(llama, messages)
    with pytest.raises(ValueError, match="max_batch_size"):
        llama.engine.submit(tokens, RequestSettings(max_new_tokens=1), images=images)


@pytest.fixture(scope="module")
def traffic(vision):
    """Prompts of no, one and two images."""
    _, llama = vision
    return [encode(llama, [{"role": "user", "content": "Tell me about the sea."}]),
            encode(llama, DIALOGS["image at the start"]), encode(llama, DIALOGS["two images"]),
            encode(llama, DIALOGS["image mid-dialog"])]


@settings(max_examples=6, deadline=None)  # ~25 s
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 24), st.sampled_from(["", "cancel", "preempt"])),
                min_size=1, max_size=6),
       st.randoms(use_true_random=False))
def test_random_traffic_keeps_the_image_books_straight(vision, traffic, requests, rng):
    """Requests with and without images arriving, finishing, being cancelled and being preempted
    (the scheduler's own preemption, of a random running request between steps) at random steps
    in a small block pool: after every step the held contexts are running requests' and the slots
    within the pool; each request's tokens are what it gets alone; at the end nothing is held."""
    _, llama = vision
    engine = engine_of(llama, prefill_chunk=16, kv_cache_tokens=160).engine
    handles, cancelled = [], set()
    for kind, new, action in requests:
        tokens, images = traffic[kind]
        settings_ = RequestSettings(max_new_tokens=new, **GREEDY)  # type: ignore[arg-type]
        handles.append(engine.submit(tokens, settings_, images=images))
        for _ in range(rng.randrange(4)):
            engine.step()
            books_straight(engine)
        if action == "cancel":
            handle = rng.choice(handles)
            handle.cancel()
            cancelled.add(handle.id)
        elif action == "preempt" and engine.scheduler.running:
            with engine.lock:
                engine.scheduler.preempt(rng.choice(list(engine.scheduler.running.values())))
            books_straight(engine)
    while not all(h.finished for h in handles):
        engine.step()
        books_straight(engine)
    all_back(engine)
    for handle, (kind, new, _) in zip(handles, requests):
        if handle.id not in cancelled:
            assert handle.result().tokens == alone(llama, kind, new, traffic)


_ALONE: dict[tuple[int, int], list[int]] = {}


def alone(llama: Llama, kind: int, new: int, traffic) -> list[int]:
    """The greedy tokens of traffic prompt ``kind`` alone (the model called directly), cached."""
    if (kind, 24) not in _ALONE:
        _ALONE[kind, 24] = reference_greedy(llama, *traffic[kind], 24)
    return _ALONE[kind, 24][:new]


# -- the prefix cache and the compiled step ------------------------------------------------------

def test_the_prefix_cache_shares_blocks_only_with_the_same_image(vision):
    """The same dialog again reuses its prompt's blocks past the image and gives the same tokens;
    the same text with another image reuses only the blocks before the image (the text before an
    image does not depend on it), and gives the model's tokens for its image."""
    _, llama = vision
    engine = engine_of(llama)
    tokens, images = encode(llama, DIALOGS["image mid-dialog"])
    first = run(engine, tokens, images, 6)
    assert first.n_cached_prompt_tokens == 0
    again = run(engine, *encode(llama, DIALOGS["image mid-dialog"]), 6)
    assert again.tokens == first.tokens
    assert again.n_cached_prompt_tokens > images[0].start  # past the image: its blocks were shared
    other_dialog = [*DIALOGS["image mid-dialog"][:2],
                    {"role": "user", "content": [text("What is in"), image(BLUE), text("?")]}]
    other_tokens, other_images = encode(llama, other_dialog)
    assert other_tokens == tokens  # the same ids: only the image differs
    other = run(engine, other_tokens, other_images, 6)
    assert 0 < other.n_cached_prompt_tokens <= images[0].start  # the text before the image only
    assert other.tokens == reference_greedy(llama, other_tokens, other_images, 6)
    assert other.tokens != first.tokens


def test_a_compiled_step_leaves_rows_with_images_to_an_eager_step(vision, caplog):
    """Under compile=True the compiled decoding step takes no image cross-attention: a step with
    an image row runs eagerly (said once in the log) and gives the model's tokens; a text-only
    step still runs the compiled one.  (The compiled step is stood in for by a recorder around
    decode_logits: compiling it takes minutes on a CPU; tests/test_compiled.py covers it.)"""
    _, llama = vision
    engine = engine_of(llama).engine
    runner = engine.runner
    compiled_rows: list[int] = []

    def compiled_step(tokens, positions, kv_len, cache, table=None, lora_slots=None):
        compiled_rows.append(tokens.shape[0])
        return llama.model.decode_logits(tokens, positions, kv_len, cache, table, lora_slots)

    runner.decode_step, runner.fixed_shape = compiled_step, True  # what compile() sets, bar the compilation
    tokens, images = encode(llama, DIALOGS["two images"])
    plain = encode(llama, [{"role": "user", "content": "Tell me about the sea."}])[0]
    settings = RequestSettings(max_new_tokens=6, **GREEDY)  # type: ignore[arg-type]
    with caplog.at_level("INFO", logger="llama.engine.runner"):
        assert engine.submit(tokens, settings, images=images).result().tokens == \
            reference_greedy(llama, tokens, images, 6)
        assert not compiled_rows
        text_only = engine.submit(plain, settings).result().tokens
    assert text_only == reference_greedy(llama, plain, [], 6) and compiled_rows
    assert sum("run eagerly" in r.getMessage() for r in caplog.records) == 1


def test_speculative_decoding_verifies_image_rows_with_their_images(vision):
    """Prompt-lookup speculation: the passes that verify proposals give image rows their
    cross-attention too, so the tokens are the model's (with a text-only request beside)."""
    _, llama = vision
    engine = engine_of(llama, speculative={"method": "ngram", "num_tokens": 4}).engine
    prompts = [encode(llama, DIALOGS["two images"]), encode(llama, [{"role": "user", "content": "Sea, sea, sea."}])]
    settings = RequestSettings(max_new_tokens=24, **GREEDY)  # type: ignore[arg-type]
    handles = [engine.submit(tokens, settings, images=images) for tokens, images in prompts]
    for (tokens, images), handle in zip(prompts, handles):
        assert handle.result().tokens == reference_greedy(llama, tokens, images, 24)
    assert engine.stats()["spec_proposed_tokens_total"] > 0
    assert len(engine.image_contexts) == 0


# -- structured output and tool calls with an image -------------------------------------------------

COLOUR = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "count"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string", "maxLength": 8}},
                                                           "required": ["city"], "additionalProperties": False}}}


def constrained_reference(llama: Llama, tokens: list[int], images: list[MllamaPromptImage], grammar,
                          n: int) -> list[int]:
    """At most ``n`` greedy tokens from the model called directly (as :func:`reference_greedy`),
    each the best of the ids the grammar's own matcher allows at that step, up to its end token."""
    model = llama.model
    matcher = grammar.matcher(llama.engine.grammar_end_ids(RequestSettings(max_new_tokens=1, grammar=grammar)))
    t = torch.tensor([tokens])
    batch = stack_images([images])
    context = model.image_context(batch.pixel_values, batch.aspect_ratio_ids, t)
    logits = model.forward(t, 0, images=context)[0, -1]
    out: list[int] = []
    while len(out) < n and not matcher.is_ended:
        allowed = torch.tensor(matcher.allowed_ids())
        out.append(int(allowed[logits[allowed].argmax()]))
        matcher.consume(out[-1])
        logits = model.forward(torch.tensor([[out[-1]]]), len(tokens) + len(out) - 1, images=context)[0, -1]
    return out


def test_a_json_schema_reply_about_an_image_is_the_constrained_greedy_one(vision):
    """``response_format`` with an image: the chat reply is valid JSON of the schema, and its text
    that of the model's greedy tokens constrained step by step by the grammar's matcher (the
    model called directly); the image matters (another gives another reply here)."""
    import json

    import jsonschema

    _, llama = vision
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR}}
    dialog = [{"role": "user", "content": [image(RED), text("Which colour is it, and how many dots?")]}]
    (reply,) = llama.chat_completion([dialog], temperature=0, max_gen_len=60, response_format=fmt)
    content = reply["generation"]["content"]
    jsonschema.validate(json.loads(content), COLOUR)
    tokens, images = encode(llama, dialog)
    expected = constrained_reference(llama, tokens, images, llama._grammar(fmt), 60)
    assert expected[-1] in llama.tokenizer.stop_tokens and content == llama.tokenizer.decode(expected[:-1])
    assert len(llama.engine.image_contexts) == 0


def test_a_forced_tool_call_about_an_image_is_the_constrained_greedy_one(vision_files):
    """A named ``tool_choice`` with an image: one call of that function whose arguments follow its
    schema, the same call as the model's greedy tokens under the tool-call grammar (model direct).
    (A model of its own: the tool prompt is 186 tokens, past the module's max_seq_len.)"""
    import jsonschema

    from llama.formats.tool_call_parser import parse_tool_calls

    llama = Llama.build(vision_files[1] / "meta", max_seq_len=320, max_batch_size=1, device="cpu", dtype="float32")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    dialog = [{"role": "user", "content": [text("Where was this taken? Get its weather."), image(GREEN)]}]
    (reply,) = llama.chat_completion([dialog], temperature=0, max_gen_len=60, tools=[WEATHER], tool_choice=choice)
    (call,) = reply["generation"]["tool_calls"]
    assert call["tool_name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER["function"]["parameters"])
    fmt = llama.formatter.check_tool_prompt_format(None)
    encoded = llama.formatter.encode_dialog(dialog, fmt, tools=[WEATHER])
    grammar = llama.structured.tool_choice([WEATHER], choice, fmt, True)
    expected = constrained_reference(llama, encoded.tokens, encoded.images, grammar, 60)
    assert expected[-1] in llama.tokenizer.stop_tokens
    _, calls = parse_tool_calls(llama.tokenizer.decode(expected[:-1]))
    assert [(c["tool_name"], c["arguments"]) for c in calls] == [("get_weather", call["arguments"])]


@pytest.mark.multiprocess
def test_two_ranks_give_one_ranks_greedy_tokens(vision_files, vision, tmp_path):
    """The checkpoint in two shards on two ranks (torchrun, gloo; tests/images_mp_worker.py, as for
    Llama 4): chats about a 1-tile and a 2-tile picture, and one without, give the greedy tokens
    and log-probabilities of one process (the encoder, the cross-attention K/V and the text
    model split over the ranks)."""
    import helpers
    from images_mp_worker import answer

    _, root = vision_files
    two_shards = mh.convert_hf_folder(root / "hf", tmp_path / "meta2", model_parallel_size=2)
    images = []
    for name, data in (("red", RED), ("green", GREEN)):
        images.append(tmp_path / f"{name}.png")
        images[-1].write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    result = helpers.torchrun(helpers.REPO / "tests" / "images_mp_worker.py",
                              [str(two_shards), str(out), *map(str, images)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = answer(vision[1], [str(p) for p in images])
    assert len({tuple(r["tokens"]) for r in expected}) == len(expected)  # each picture, and none, its own reply
    for rank in range(2):
        got = torch.load(out / f"rank{rank}.pt")
        assert [r["tokens"] for r in got] == [r["tokens"] for r in expected]
        for g, e in zip(got, expected):
            assert g["logprobs"] == pytest.approx(e["logprobs"], abs=1e-4)
