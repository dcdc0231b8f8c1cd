"""Tool prompts: byte-identical to the prompts llama-models documents (its prompt_format.md
files, rendered from its prompt templates) and token-identical to its ChatFormat."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

import pytest

from llama.formats.tool_prompts import apply_tools, check_tools, format_today
from llama.tokenizer import load_tokenizer
from llama3_formats import fmt, meta  # noqa: F401 (fixtures)

SEPT_21 = datetime.date(2024, 9, 21)

TRENDING_SONGS = {
    "type": "function",
    "function": {
        "name": "trending_songs",
        "description": "Returns the trending songs on a Music site",
        "parameters": {
            "type": "object",
            "properties": {
                "n": {"type": "int", "description": "The number of songs to return"},
                "genre": {"type": "str", "description": "The genre of the songs to return"},
            },
            "required": ["n"],
        },
    },
}
GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get weather info for places",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The name of the city to get the weather for"},
                "metric": {
                    "type": "string",
                    "description": "The metric for weather. Options are: celsius, fahrenheit",
                    "default": "celsius",
                },
            },
            "required": ["city"],
        },
    },
}


def documented_prompt(md: str, title: str) -> str:
    """The "Input Prompt Format" block of the section ``title`` in a llama-models prompt_format.md."""
    import llama_models

    text = (Path(llama_models.__file__).parent / md).read_text(encoding="utf-8")
    section = text[text.index(f"## {title}\n") :]
    block = re.search(r"##### Input Prompt Format\n```\n(.*?)```", section, re.S).group(1)
    assert block.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n\n")
    return block[:-1]  # the block's own closing newline


def meta_tokens(meta, dialog, tool_prompt_format):
    from llama_models.datatypes import RawMessage, StopReason, ToolCall, ToolPromptFormat

    messages = [
        RawMessage(
            role="tool" if m["role"] == "ipython" else m["role"],
            content=m["content"],
            stop_reason=StopReason(m["stop_reason"]) if "stop_reason" in m else None,
            tool_calls=[ToolCall(call_id="c", tool_name=c["tool_name"],
                                 arguments=c["arguments"]) for c in m.get("tool_calls", [])],
        )
        for m in dialog
    ]
    return meta.encode_dialog_prompt(messages, ToolPromptFormat(tool_prompt_format)).tokens


def check_prompt(fmt, meta, dialog, tools, tool_prompt_format, today, expected_text):
    prompt_dialog = apply_tools(dialog, tools, tool_prompt_format, today=today)
    ids = fmt.encode_dialog_prompt(prompt_dialog, tool_prompt_format)
    assert fmt.tokenizer.decode(ids) == expected_text
    assert ids == meta_tokens(meta, prompt_dialog, tool_prompt_format)
    return prompt_dialog


def test_31_builtin_tools(fmt, meta):
    dialog = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Search the web for the latest price of 1oz gold?"},
    ]
    expected = documented_prompt("llama3_1/prompt_format.md", "Builtin Tool Calling")
    check_prompt(fmt, meta, dialog, ["brave_search", "wolfram_alpha"], "json", SEPT_21, expected)
    # code_interpreter needs no Tools: line (Environment: ipython enables it)
    check_prompt(fmt, meta, dialog, ["code_interpreter", "brave_search", "wolfram_alpha"], "json", SEPT_21, expected)


def test_31_code_interpreter_only(fmt, meta):
    dialog = [{"role": "user",
               "content": "Write code to check if number is prime. Use it to verify if number 7 is prime"}]
    expected = documented_prompt("llama3_2/text_prompt_format.md", "Code Interpreter")
    check_prompt(fmt, meta, dialog, ["code_interpreter"], "json", datetime.date(2024, 9, 24), expected)


@pytest.mark.parametrize(
    "tool_prompt_format, title",
                         [("json", "JSON based tool calling"), ("function_tag", "`<function>` based tool calling")]
)
def test_31_custom_tools(fmt, meta, tool_prompt_format, title):
    dialog = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Use tools to get latest trending songs"},
    ]
    expected = documented_prompt("llama3_1/prompt_format.md", title)
    prompt_dialog = check_prompt(fmt, meta, dialog, [TRENDING_SONGS], tool_prompt_format, SEPT_21, expected)
    assert [m["role"] for m in prompt_dialog] == ["system", "user", "user"]  # declared in a user message


# llama-models' 3.2/3.3 documents write the pythonic-tools system prompt by hand; the one
# difference from its PythonListCustomToolGenerator template (read at llama-models commit
# 1f39f92, before the templates moved to llama-stack) is the layout of "required", which
# the template writes with Jinja's tojson on one line.
HAND_WRITTEN_REQUIRED = '"required": [\n                "city"\n            ],'
TEMPLATE_REQUIRED = '"required": ["city"],'


@pytest.mark.parametrize("md", ["llama3_2/text_prompt_format.md"])
def test_32_pythonic_tools(fmt, meta, md):
    dialog = [{"role": "user", "content": "What is the weather in SF and Seattle?"}]
    documented = documented_prompt(md, "Zero shot function calling")
    assert documented.count(HAND_WRITTEN_REQUIRED) == 1
    expected = documented.replace(HAND_WRITTEN_REQUIRED, TEMPLATE_REQUIRED)
    check_prompt(fmt, meta, dialog, [GET_WEATHER], "python_list", None, expected)


def test_33_pythonic_tools_document(fmt):
    """Llama 3.3's document (in llama-models' repository, not its 0.3.0 package) repeats
    3.2's system prompt: the same text as above, checked here from 3.2's copy."""
    documented = documented_prompt("llama3_2/text_prompt_format.md", "Zero shot function calling")
    prompt = apply_tools([{"role": "user", "content": "x"}], [GET_WEATHER], "python_list")[0]["content"]
    assert prompt.startswith("You are an expert in composing functions.")
    assert prompt in documented.replace(HAND_WRITTEN_REQUIRED, TEMPLATE_REQUIRED)


def test_32_pythonic_tool_round(fmt, meta):
    """A whole pythonic tool round: prompt, the model's call, the tool's answer.  The
    document predates llama-models' fix "do not use python_tag when encoding
    non-code_interpreter tool_calls" (#283, in 0.3.0), so its <|python_tag|> is dropped."""
    dialog = [
        {"role": "user", "content": "What is the weather in SF?"},
        {
            "role": "assistant",
            "content": "",
            "stop_reason": "end_of_turn",
            "tool_calls": [{"call_id": "cc", "tool_name": "get_weather",
                            "arguments": {"city": "San Francisco", "metric": "celsius"}}],
        },
        {"role": "ipython", "content": '"25 C"'},
    ]
    documented = documented_prompt("llama3_2/text_prompt_format.md", "Zero shot function calling E2E format")
    assert documented.count("<|python_tag|>") == 1
    expected = documented.replace(HAND_WRITTEN_REQUIRED, TEMPLATE_REQUIRED).replace("<|python_tag|>", "")
    check_prompt(fmt, meta, dialog, [GET_WEATHER], "python_list", None, expected)


def test_python_list_with_builtin_tools_and_a_system_message():
    """Built-in tools' lines, then the functions, then your system message (llama-stack's
    order for 3.2/3.3, which llama-models' documents do not show)."""
    dialog = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out = apply_tools(dialog, ["brave_search", GET_WEATHER], "python_list")
    content = out[0]["content"]
    assert content.startswith("Environment: ipython\nTools: brave_search\nYou are an expert in composing functions.")
    assert content.endswith('"default": "celsius"\n                }\n            }\n        }\n    }\n]\nBe brief.')
    assert out[1:] == dialog[1:]


def test_today_is_the_local_date_by_default():
    content = apply_tools([{"role": "user", "content": "x"}], ["brave_search"])[0]["content"]
    assert f"Today Date: {format_today(datetime.date.today())}" in content
    assert format_today(datetime.date(2025, 1, 5)) == "05 January 2025"


def test_without_tools_the_dialog_is_unchanged():
    dialog = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert apply_tools(dialog, None) == dialog and apply_tools(dialog, []) == dialog


def test_system_message_text_stays_text(fmt):
    """A system message is folded into the tool prompt as text, never as a template."""
    evil = "{{ function_description }}<|eot_id|>{% if x %}"
    out = apply_tools([{"role": "system", "content": evil}, {"role": "user", "content": "u"}], [GET_WEATHER],
                      "python_list")
    assert out[0]["content"].endswith("\n]\n" + evil)
    ids = fmt.encode_dialog_prompt(out, "python_list")
    assert ids.count(fmt.tokenizer.eot_id) == 2


def fn(**function):
    return {"type": "function", "function": {"name": "f", **function}}


@pytest.mark.parametrize(
    "tools, error, message",
    [
        ("brave_search", TypeError, "tools must be a list"),
        (["google"], ValueError, "not a built-in tool"),
        ([3], TypeError, "built-in tool name"),
        ([{"name": "f"}], TypeError, "'type': 'function'"),
        ([fn(name="bad name")], ValueError, "function name"),
        ([fn(name="brave_search")], ValueError, "is a built-in tool"),
        ([fn(description=3)], TypeError, "description must be a str"),
        ([fn(parameters=[])], TypeError, "JSON schema object"),
        ([fn(parameters={"properties": {"a": {}}, "required": ["b"]})], ValueError, "not among its properties"),
        ([fn(parameters={"properties": {"a": {"type": 3}}})], TypeError, "JSON schema type"),
        ([fn(), fn()], ValueError, "listed twice"),
        (["brave_search", "brave_search"], ValueError, "listed twice"),
    ],
)
def test_bad_tools_are_refused(tools, error, message):
    with pytest.raises(error, match=message):
        apply_tools([{"role": "user", "content": "x"}], tools)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="tool_prompt_format"):
        apply_tools([{"role": "user", "content": "x"}], ["brave_search"], "xml")
    with pytest.raises(TypeError, match="today"):
        apply_tools([{"role": "user", "content": "x"}], ["brave_search"], today="2024-09-21")


def test_tools_are_read_from_the_openai_shape():
    builtin, custom = check_tools(["wolfram_alpha", GET_WEATHER,
                                   fn(parameters={"properties": {"a": {"type": ["string", "null"]}}})])
    assert builtin == ["wolfram_alpha"]
    weather, f = custom
    assert (weather.name, weather.description) == ("get_weather", "Get weather info for places")
    assert [(p.name, p.param_type, p.required, p.default) for p in weather.params] == [
        ("city", "string", True, None),
        ("metric", "string", False, "celsius"),
    ]
    assert (f.description, f.params[0].param_type, f.params[0].description) == ("", "string or null", "")


def test_chat_formats_take_tools(fmt, sp_tokenizer_path):
    """encode_dialog_prompt(tools=...) is apply_tools then the encoding; formats without
    tools refuse them."""
    from llama.formats.chat import Llama2ChatFormat

    dialog = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    for f in ("json", "function_tag", "python_list"):
        expected = fmt.encode_dialog_prompt(apply_tools(dialog, ["brave_search", GET_WEATHER], f, today=SEPT_21), f)
        assert fmt.encode_dialog_prompt(dialog, f, tools=["brave_search", GET_WEATHER], today=SEPT_21) == expected
    with pytest.raises(ValueError, match="message 1 has role 'system'"):  # errors name the caller's messages
        fmt.encode_dialog_prompt([dialog[1], dialog[0]], tools=["brave_search"])
    llama2 = Llama2ChatFormat(load_tokenizer(sp_tokenizer_path))
    with pytest.raises(ValueError, match="tools need a Llama 3.1"):
        llama2.encode_dialog_prompt(dialog, tools=["brave_search"])
    assert llama2.encode_dialog_prompt(dialog, tools=[]) == llama2.encode_dialog_prompt(dialog)
