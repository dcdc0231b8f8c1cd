"""``tool_choice`` "required" and named functions: replies constrained to well-formed calls in the
model's own tool format (llama.structured.tool_choice), through the grammar alone (random walks
on Meta's Llama 3 tokenizer) and through the engine and the Python API (a random-weight Llama 3
checkpoint sampled at temperature 1.0, so that only the constraint can make a call valid).

Every reply is read back with the library's own tool-call parser and its arguments checked
with ``jsonschema`` against the function's ``parameters``."""

from __future__ import annotations

import codecs
import json
import re

import jsonschema
import pytest

from helpers import build
from llama.formats.tool_call_parser import parse_tool_calls
from llama.structured import GrammarTokenizer, check_tool_choice, tool_call_grammar
from llama.structured.tool_choice import tool_call_lark
from llama.tokenizer import load_tokenizer
from test_grammar import walk

FORMATS = ("json", "function_tag", "python_list")


def function(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": parameters}}


# Bounded schemas (every walk through them ends), each keyword a call may meet.
WEATHER = function("get_weather", {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city"],
    "additionalProperties": False,
})
LIGHTS = function("set_lights", {
    "type": "object",
    "properties": {
        "on": {"type": "boolean"},
        "rooms": {"type": "array", "items": {"enum": ["hall", "kitchen"]}, "minItems": 1, "maxItems": 2},
        "colour": {"anyOf": [{"$ref": "#/$defs/rgb"}, {"type": "null"}]},
    },
    "required": ["on", "rooms", "colour"],
    "additionalProperties": False,
    "$defs": {"rgb": {"type": "object", "properties": {"r": {"type": "integer", "minimum": 0, "maximum": 255}},
                      "required": ["r"], "additionalProperties": False}},
})
NO_ARGUMENTS = function("ping", {"type": "object", "properties": {}, "additionalProperties": False})
TOOLS = [WEATHER, LIGHTS, NO_ARGUMENTS, "brave_search"]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS if isinstance(t, dict)}


def read_calls(text: str) -> tuple[str, list]:
    """(content, calls) of a walk's text, as the chat format reads a reply (``<|python_tag|>``
    is the control token's text in a decoded walk)."""
    tag = "<|python_tag|>"
    if text.startswith(tag):
        return parse_tool_calls(text[len(tag):], python_tag=True)
    return parse_tool_calls(text)


def blank_strings(text: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def check_calls(calls: list, names: set[str]) -> None:
    assert calls, "no call"
    for call in calls:
        assert call["tool_name"] in names, call
        if call["tool_name"] == "brave_search":
            assert set(call["arguments"]) == {"query"} and isinstance(call["arguments"]["query"], str)
        else:
            jsonschema.validate(call["arguments"], SCHEMAS[call["tool_name"]])


@pytest.fixture(scope="module")
def llama3(llama3_tokenizer_path) -> GrammarTokenizer:
    return GrammarTokenizer(load_tokenizer(llama3_tokenizer_path))


# -- the grammar ---------------------------------------------------------------------------------


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@pytest.mark.parametrize("tool_prompt_format", FORMATS)
@pytest.mark.parametrize("parallel", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_required_walks_are_valid_calls_of_declared_tools(llama3, tool_prompt_format, parallel):
    grammar = tool_call_grammar(TOOLS, "required", llama3, tool_prompt_format, parallel)
    seen = set()
    for seed in range(6):
        content, calls = read_calls(walk(grammar, seed, max_tokens=600, closing=0.2))
        assert content == ""
        check_calls(calls, {"get_weather", "set_lights", "ping", "brave_search"})
        assert parallel or len(calls) == 1
        seen |= {c["tool_name"] for c in calls}
    assert len(seen) >= 3, seen  # the walks reach the alternatives, not just one


@pytest.mark.slow  # random walks over Meta's 128k vocabulary; the engine test below checks a named call quickly
@pytest.mark.parametrize("tool_prompt_format", FORMATS)
@pytest.mark.parametrize("name", ["set_lights", "brave_search", "ping"])
def test_a_named_function_is_the_only_one_called(llama3, tool_prompt_format, name):
    grammar = tool_call_grammar(TOOLS, {"type": "function", "function": {"name": name}}, llama3, tool_prompt_format)
    for seed in range(3):
        content, calls = read_calls(walk(grammar, seed, max_tokens=600, closing=0.2))
        assert content == ""
        check_calls(calls, {name})


@pytest.mark.parametrize("tool_prompt_format", FORMATS)
def test_calls_are_written_as_the_model_was_shown_them(llama3, tool_prompt_format):
    """The arguments' JSON is written as json.dumps writes it (and as the tool prompts show
    calls), and a pythonic call's arguments come in the order of the schema's properties."""
    grammar = tool_call_grammar([WEATHER], "required", llama3, tool_prompt_format, False)
    for seed in range(4):
        text = walk(grammar, seed)
        _, (call,) = read_calls(text)
        args = call["arguments"]
        if tool_prompt_format == "json":
            expected = json.dumps({"type": "function", "name": "get_weather", "parameters": args})
        elif tool_prompt_format == "function_tag":
            expected = f"<function=get_weather>{json.dumps(args)}</function>"
        else:
            expected = "[get_weather(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items()) + ")]"
        # The same text outside the strings (which may spell a character escaped or not).
        assert blank_strings(text) == blank_strings(expected)
        if tool_prompt_format == "python_list":
            order = list(SCHEMAS["get_weather"]["properties"])
            assert list(args) == sorted(args, key=order.index)


@pytest.mark.slow  # open objects make long walks
def test_an_open_schema_allows_any_object(llama3):
    """No ``properties`` and no ``additionalProperties: false``: any JSON object is valid
    arguments (a walk biased towards closing characters, as an open object need not end)."""
    tools = [function("anything", {}), function("typed", {"type": "object"})]
    for tool_prompt_format in ("json", "function_tag"):
        grammar = tool_call_grammar(tools, "required", llama3, tool_prompt_format)
        for seed in range(4):
            content, calls = read_calls(walk(grammar, seed, max_tokens=1500, closing=0.5))
            assert content == "" and calls and all(isinstance(c["arguments"], dict) for c in calls)


def test_code_interpreter_named_is_code_after_the_python_tag(llama3):
    grammar = tool_call_grammar(["code_interpreter", WEATHER],
                                {"type": "function", "function": {"name": "code_interpreter"}},
                                llama3)
    assert tool_call_lark(["code_interpreter"], check_tool_choice("required", ["code_interpreter"])).startswith(
        "start: <|python_tag|>")
    m = grammar.matcher()
    assert m.allowed_ids() == [llama3.tokenizer.special_tokens["<|python_tag|>"]]


# -- checking tool_choice ------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice, tools, message", [
    ("sometimes", TOOLS, "tool_choice must be one of"),
    ("required", None, "needs tools"),
    ("required", [], "needs tools"),
    ({"type": "function", "function": {"name": "nowhere"}}, TOOLS, "'nowhere', which is not among the tools"),
    ({"type": "function", "function": {"name": "get_weather"}}, None, "no tools are declared"),
    ({"type": "function", "name": "get_weather"}, TOOLS, "must be a string or"),
    ({"type": "tool", "function": {"name": "get_weather"}}, TOOLS, "must be a string or"),
    ({"type": "function", "function": {"name": 3}}, TOOLS, "name must be the name"),
    (3, TOOLS, "must be a string or"),
])
def test_bad_tool_choices_are_value_errors(tool_choice, tools, message):
    with pytest.raises(ValueError, match=message):
        check_tool_choice(tool_choice, tools)


def test_choices_that_constrain_nothing(llama3):
    for choice in (None, "auto", "none"):
        assert tool_call_grammar(TOOLS, choice, llama3) is None
    assert check_tool_choice("none", None).callable(frozenset({"f"})) == frozenset()
    assert check_tool_choice(None, TOOLS).mode == "auto"


@pytest.mark.parametrize("tool, tool_prompt_format, message", [
    (function("f", {"type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}}), "json",
     r"tools\[1\]\.function\.parameters"),
    (function("f", {"type": "array"}), "json", "must be a schema of type 'object'"),
    (function("f", {"type": "object", "properties": {"first-name": {"type": "string"}}}), "python_list",
     "'first-name' is no Python name"),
    (function("f", {"type": "object", "properties": {"class": {"type": "string"}}}), "python_list",
     "'class' is no Python name"),
    (function("f", {"type": "object", "patternProperties": {"^a": {}}}), "python_list", "'patternProperties'"),
])
def test_schemas_that_cannot_be_followed_are_value_errors_naming_the_tool(llama3, tool, tool_prompt_format, message):
    with pytest.raises(ValueError, match=message):
        tool_call_grammar([WEATHER, tool], "required", llama3, tool_prompt_format)


# -- through the engine and the Python API --------------------------------------------------------

DIALOG = [{"role": "user", "content": "what is the weather in Paris?"}]
ROOM = 300
# The bounded ones: a sampled brave_search query need not end.
BOUNDED = [WEATHER, LIGHTS, NO_ARGUMENTS]


@pytest.fixture(scope="module")
def llama(llama3_checkpoint):
    return build(llama3_checkpoint, max_seq_len=4096, max_batch_size=4)  # a tiny tokenizer: long prompts


@pytest.mark.parametrize("tool_prompt_format", FORMATS)
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_required_replies_are_calls(llama, tool_prompt_format):
    for seed in range(3):
        (out,) = llama.chat_completion([DIALOG], temperature=1.0, top_p=1.0, max_gen_len=ROOM, seed=seed,
                                       tools=BOUNDED, tool_prompt_format=tool_prompt_format, tool_choice="required")
        message = out["generation"]
        assert message["content"] == "" and message["stop_reason"] in ("end_of_turn", "end_of_message"), message
        check_calls(message["tool_calls"], {"get_weather", "set_lights", "ping"})


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_named_reply_calls_that_function_once_without_parallel_calls(llama):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        (out,) = llama.chat_completion([DIALOG], temperature=1.0, top_p=1.0, max_gen_len=ROOM, seed=seed,
                                       tools=BOUNDED, tool_choice=choice, parallel_tool_calls=False)
        (call,) = out["generation"]["tool_calls"]
        assert call["tool_name"] == "get_weather"
        jsonschema.validate(call["arguments"], SCHEMAS["get_weather"])


def test_none_declares_no_tools_and_reads_no_calls(llama):
    encode = llama.formatter.encode_dialog_prompt
    assert encode(DIALOG) != encode(DIALOG, tools=TOOLS)  # the tools change the prompt ...
    free = llama.chat_completion([DIALOG], temperature=0, max_gen_len=20)
    none = llama.chat_completion([DIALOG], temperature=0, max_gen_len=20, tools=TOOLS, tool_choice="none")
    assert none == free  # ... and "none" leaves them out
    assert none[0]["generation"]["tool_calls"] == []


def test_a_stream_ends_with_the_same_calls(llama):
    kwargs = dict(temperature=1.0, top_p=1.0, max_gen_len=ROOM, seed=5, tools=BOUNDED, tool_choice="required",
                  tool_prompt_format="python_list")
    (whole,) = llama.chat_completion([DIALOG], **kwargs)
    stream = llama.chat_completion_stream(DIALOG, **kwargs)
    text = "".join(stream)
    strip = lambda calls: [(c["tool_name"], c["arguments"]) for c in calls]  # noqa: E731  (fresh call ids)
    assert strip(stream.message["tool_calls"]) == strip(whole["generation"]["tool_calls"])
    assert text.startswith("[") and stream.message["content"] == ""


@pytest.mark.parametrize("kwargs, message", [
    (dict(tool_choice="required", response_format={"type": "json_object"}), "give one or the other"),
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
    (dict(tool_choice="required", parallel_tool_calls="yes"), "parallel_tool_calls must be a bool"),
    (dict(tool_choice="required", tool_prompt_format="python_list",
          tools=[function("f", {"type": "object", "properties": {"a-b": {}}})]), "no Python name"),
])
def test_bad_tool_requests_are_refused_before_generating(llama, kwargs, message):
    kwargs = {"tools": TOOLS, **kwargs}
    before = llama.engine.stats()["requests_total"]
    with pytest.raises((ValueError, TypeError), match=message):
        llama.chat_completion([DIALOG], max_gen_len=5, **kwargs)
    assert llama.engine.stats()["requests_total"] == before


# -- streamed deltas -----------------------------------------------------------------------------


def assemble(deltas: list[dict]) -> list[dict]:
    """OpenAI's tool-call deltas put together as a client does: by index, the id, type and
    name from the first, the arguments concatenated."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "type": None, "function": {"name": None, "arguments": ""}})
        for key in ("id", "type"):
            if key in d:
                assert call[key] is None, "announced twice"
                call[key] = d[key]
        if "name" in d["function"]:
            call["function"]["name"] = d["function"]["name"]
        call["function"]["arguments"] += d["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return [calls[k] for k in sorted(calls)]


@pytest.mark.parametrize("tool_prompt_format", FORMATS)
def test_streamed_deltas_concatenate_to_the_calls_read_whole(llama3, tool_prompt_format):
    """Fed the reply piece by piece (token by token, then character by character), the deltas
    announce each call before the reply ends and add up to the calls read from the whole reply."""
    from llama.formats.tool_call_stream import ToolCallDeltas
    from llama.formats.tool_calls import to_openai_tool_calls

    grammar = tool_call_grammar(TOOLS, "required", llama3, tool_prompt_format)
    tokenizer = llama3.tokenizer
    for seed in range(5):
        text = walk(grammar, seed, max_tokens=600, closing=0.2)
        _, calls = read_calls(text)
        ids = tokenizer.encode(text.removeprefix("<|python_tag|>"), bos=False, eos=False)
        utf8 = codecs.getincrementaldecoder("utf-8")()  # as the engine releases text: whole characters
        pieces = (["<|python_tag|>"] if text.startswith("<|python_tag|>") else []) + [
            utf8.decode(tokenizer.model.decode_single_token_bytes(i)) for i in ids]
        for cut in (pieces, list(text)):
            reader, so_far, streamed = ToolCallDeltas(tool_prompt_format), "", []
            for piece in cut:
                so_far += piece
                streamed += reader.feed(so_far)
            assert so_far == text
            assert streamed and streamed[0]["function"]["name"] == calls[0]["tool_name"]  # told before the end
            whole = to_openai_tool_calls(calls)
            got = assemble(streamed + reader.finish(calls))
            assert [(c["type"], c["function"]) for c in got] == [(c["type"], c["function"]) for c in whole], text
            assert all(c["id"] for c in got)


# -- Llama 4 -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama4_tokenizer_path():
    llama_models = pytest.importorskip("llama_models")
    from pathlib import Path

    return Path(llama_models.__file__).parent / "llama4" / "tokenizer.model"


@pytest.fixture(scope="module")
def llama4_tokenizer(llama4_tokenizer_path):
    """Meta's Llama 4 tokenizer (202k ids: a second or more to load), loaded once for the file."""
    return load_tokenizer(llama4_tokenizer_path)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_llama4_declares_functions_in_its_system_prompt(llama4_tokenizer):
    """The functions are listed (as JSON, "type": "dict" as Meta writes it) in a system message
    after Llama 4's tool rules; the user's system message follows; the reply form Meta documents
    (``[get_weather(city="San Francisco"), get_weather(city="Seattle")]<|eot|>``) reads as two
    calls; built-in tools and other call formats are refused."""
    from llama.formats.chat import chat_format_for
    from llama.formats.tool_prompts import LLAMA4_TOOLS_INTRO

    tokenizer = llama4_tokenizer
    fmt = chat_format_for(tokenizer)
    dialog = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in SF and Seattle?"}]
    prompt = tokenizer.decode(fmt.encode_dialog_prompt(dialog, tools=[WEATHER, LIGHTS]))
    system = prompt.split("<|header_start|>system<|header_end|>\n\n", 1)[1].split("<|eot|>", 1)[0]
    assert system.startswith(LLAMA4_TOOLS_INTRO + "Here is a list of functions in JSON format that you can invoke:\n[")
    listed, own = system[len(LLAMA4_TOOLS_INTRO):].split("\n", 1)[1].rsplit("\n", 1)
    assert own == "Be brief."
    declared = json.loads(listed)
    assert [d["name"] for d in declared] == ["get_weather", "set_lights"]
    assert declared[0]["parameters"] == {"type": "dict", "required": ["city"], "properties": {
        "city": {"type": "string", "description": ""}, "unit": {"type": "any", "description": ""},
        "days": {"type": "integer", "description": ""}}}
    assert prompt.endswith("Weather in SF and Seattle?<|eot|><|header_start|>assistant<|header_end|>\n\n")

    reply = tokenizer.encode('[get_weather(city="San Francisco"), get_weather(city="Seattle")]', bos=False, eos=False)
    message = fmt.reply_message(reply, "end_of_turn", tools={"get_weather"})
    assert [(c["tool_name"], c["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "San Francisco"}), ("get_weather", {"city": "Seattle"})]
    assert fmt.reply_message(reply, "end_of_turn", tools={"set_lights"})["tool_calls"] == []  # undeclared: text
    # The call goes back into the dialog as Llama 4 writes it, ending with <|eom|>.
    turn = dialog + [{"role": "assistant", "content": "", "tool_calls": message["tool_calls"]},
                     {"role": "tool", "content": "sunny"}]
    assert ('<|header_start|>assistant<|header_end|>\n\n[get_weather(city="San Francisco"), '
            'get_weather(city="Seattle")]<|eom|>') in tokenizer.decode(fmt.encode_dialog_prompt(turn, tools=[WEATHER]))
    with pytest.raises(ValueError, match="custom functions only"):
        fmt.encode_dialog_prompt(dialog, tools=[WEATHER, "brave_search"])
    with pytest.raises(ValueError, match="python_list format, not 'json'"):
        fmt.encode_dialog_prompt(dialog, "json", tools=[WEATHER])


@pytest.mark.slow  # a model of Llama 4's 202k-id vocabulary
def test_llama4_required_replies_are_calls(tmp_path, llama4_tokenizer_path, llama4_tokenizer):
    """A random-weight Llama 4 (Meta's tokenizer, 202k ids) sampled at temperature 1: with
    tool_choice "required" every reply is a pythonic list of valid calls, streamed or not."""
    import llama4_helpers as H
    from llama.generation import Llama

    vocab = llama4_tokenizer.n_words
    params = {**H.LLAMA4_PARAMS, "vocab_size": vocab}
    ckpt = H.write_llama4_checkpoint(tmp_path, params, H.random_llama4_weights(params, vocab, seed=5))
    llama = Llama.build(ckpt, llama4_tokenizer_path, max_seq_len=2048, max_batch_size=2, device="cpu",
                        dtype="float32")
    for seed in range(3):
        kwargs = dict(temperature=1.0, top_p=1.0, max_gen_len=ROOM, seed=seed, tools=BOUNDED, tool_choice="required")
        (out,) = llama.chat_completion([DIALOG], **kwargs)
        message = out["generation"]
        assert message["content"] == "" and message["stop_reason"] in ("end_of_turn", "end_of_message"), message
        check_calls(message["tool_calls"], {"get_weather", "set_lights", "ping"})
        stream = llama.chat_completion_stream(DIALOG, **kwargs)
        text = "".join(stream)
        assert text.startswith("[") and [c["arguments"] for c in stream.message["tool_calls"]] == [
            c["arguments"] for c in message["tool_calls"]]


# -- streaming under "auto" ----------------------------------------------------------------------

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FRAGMENTS = ["Hello", " there", ",", " ", "\n", "  ", "a < b", "<", "<b>", "<func", "<function=get_weather>",
             '{"city": "Paris"}', "</function>", "<|python_tag|>", 'brave_search.call(query="news")', "brave",
             "_search", ".call(", "x.call(", '[get_weather(city="Rome")]', "{", "[", "}", "]", "Paris", "é",
             # whole calls, so that calls amid text come often
             '<function=get_weather>{"city": "Paris"}</function>',
             ' <function=get_weather>{"city": "Oslo"}</function> ',
             '<|python_tag|>brave_search.call(query="news")', ' brave_search.call(query="x") ',
             '<function=launch>{"when": "now"}</function>']


def reply_content(formatter, text: str, tools) -> str:
    """The content of a reply read whole, its ``<|python_tag|>`` text as the real token."""
    tok = formatter.tokenizer
    ids: list[int] = []
    for k, part in enumerate(text.split("<|python_tag|>")):
        if k:
            ids.append(tok.python_tag_id)
        ids += tok.encode(part, bos=False, eos=False)
    return formatter.reply_message(ids, "end_of_turn", tools=tools)["content"]


@pytest.fixture(scope="module")
def llama3_format(llama3_tokenizer_path):
    from llama.formats.chat import chat_format_for

    return chat_format_for(load_tokenizer(llama3_tokenizer_path))


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=8), builtin=st.booleans())
@example(parts=["Hello", " ", '<function=get_weather>{"city": "Paris"}</function>'], builtin=False)
@example(parts=["  ", "Hello", '<function=get_weather>{"city": "Paris"}</function>'], builtin=False)
@example(parts=["Hello", "\n", '<|python_tag|>brave_search.call(query="news")'], builtin=True)
@example(parts=["See ", 'brave_search.call(query="x") ', "ok"], builtin=True)
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_auto_content_sent_early_is_never_taken_back(llama3_format, parts, builtin):
    """Whatever the reply turns out to be (text, calls, calls amid text, a call to an undeclared
    tool), the content streamed before its end is the start of the content it has read whole."""
    from llama.formats.tool_call_stream import AutoReplyContent

    tools = {"get_weather", "brave_search"} if builtin else {"get_weather"}
    text = "".join(parts)
    final = reply_content(llama3_format, text, tools)
    reader, sent = AutoReplyContent(["brave_search"] if builtin else []), 0
    for end in range(1, len(text) + 1):
        sent = max(sent, reader.sendable(text[:end]))
        assert final.startswith(text[:sent]), (text, text[:sent], final)


def test_a_plain_auto_reply_streams_as_it_is_written():
    from llama.formats.tool_call_stream import AutoReplyContent

    text = "The weather in Paris is mild; take a coat, though.\nBye!"
    reader = AutoReplyContent(["brave_search"])
    seen = [reader.sendable(text[:end]) for end in range(1, len(text) + 1)]
    assert seen == [len(text[:end].rstrip()) for end in range(1, len(text) + 1)]
    reader = AutoReplyContent()
    assert reader.sendable("Let me look. <functi") == len("Let me look.")
    reply = 'Let me look. <function=get_weather>{"city": "Paris"}</function> done'
    assert reader.sendable(reply) == len("Let me look.")
