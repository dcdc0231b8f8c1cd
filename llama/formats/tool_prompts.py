"""Prompts that declare tools to Llama 3.1+, as Meta's llama-models templates write them.

:func:`apply_tools` takes a dialog and a list of tools and returns the dialog the model
is prompted with.  The text is byte for byte what llama-models' prompt templates
(``llama3/prompt_templates/system_prompts.py``, rendered as its ``prompt_format.md``
documents) produce for the same tools:

- ``tool_prompt_format="json"`` or ``"function_tag"`` (Llama 3.1): a system message
  ``Environment: ipython`` / ``Tools: brave_search, wolfram_alpha`` / the knowledge
  and today dates / your system message; custom functions are declared in a user
  message that follows it, as JSON or in the ``<function=...>`` style.
- ``tool_prompt_format="python_list"`` (Llama 3.2, 3.3): one system message declaring
  the functions, which the model calls as ``[f(a=1), g(b=2)]``; your system message
  follows the declaration.

A tool is a built-in tool's name (:data:`llama.formats.tool_calls.BUILTIN_TOOLS`;
``code_interpreter`` needs no ``Tools:`` line, ``Environment: ipython`` enables it) or
a function in OpenAI's shape::

    {"type": "function", "function": {"name": "get_weather", "description": "...",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "..."}},
                    "required": ["city"]}}}

Each property becomes one of llama-models' ``ToolParamDefinition`` (``param_type`` is
the property's ``type``, ``required`` whether it is listed in ``required``, ``default``
its ``default``).  Missing descriptions are empty strings.
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from llama.formats.tool_calls import BUILTIN_TOOLS, TOOL_PROMPT_FORMATS, ToolPromptFormat

__all__ = ["FunctionTool", "apply_tools", "apply_llama4_tools", "check_tools", "format_today"]

KNOWLEDGE_CUTOFF = "December 2023"
MONTHS = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)  # fmt: skip
# OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class Param:
    """One argument of a function, as llama-models' ``ToolParamDefinition``."""

    name: str
    param_type: str
    description: str
    required: bool
    default: Any = None


@dataclass(frozen=True)
class FunctionTool:
    """A custom function, as llama-models' ``ToolDefinition``."""

    name: str
    description: str
    params: tuple[Param, ...]


def format_today(today: datetime.date) -> str:
    """``21 September 2024``: the reference's ``%d %B %Y``, in English whatever the locale."""
    return f"{today.day:02d} {MONTHS[today.month - 1]} {today.year}"


# --- checking the tools -----------------------------------------------------------------


def _param_type(name: str, where: str, schema: dict) -> str:
    t = schema.get("type", "any")
    if isinstance(t, str):
        return t
    if isinstance(t, list) and t and all(isinstance(x, str) for x in t):
        return " or ".join(t)
    raise TypeError(f"{where}: property {name!r} has type {t!r}; a JSON schema type is a str or a list of str")


def _function_tool(tool: dict, where: str) -> FunctionTool:
    if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise TypeError(
            f"{where} must be a built-in tool name or {{'type': 'function', 'function': {{'name', 'description', "
            f"'parameters'}}}}, got {tool!r:.120}"
        )
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ValueError(f"{where}: the function name must be 1-64 letters, digits, '_' or '-', got {name!r:.80}")
    if name in BUILTIN_TOOLS:
        raise ValueError(f"{where}: {name!r} is a built-in tool; pass it as the string {name!r}, not as a function")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise TypeError(f"{where}: the function description must be a str, got {type(description).__name__}")
    schema = fn.get("parameters", {})
    if schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise TypeError(f"{where}: parameters must be a JSON schema object (a dict), got {type(schema).__name__}")
    properties = schema.get("properties", {})
    required = schema.get("required", [])
    if not isinstance(properties, dict):
        raise TypeError(f"{where}: parameters['properties'] must be a dict of name -> schema")
    if not isinstance(required, (list, tuple)) or not all(isinstance(r, str) for r in required):
        raise TypeError(f"{where}: parameters['required'] must be a list of property names")
    unknown = [r for r in required if r not in properties]
    if unknown:
        raise ValueError(f"{where}: parameters['required'] names {unknown}, which are not among its properties")
    params = []
    for pname, prop in properties.items():
        if not isinstance(pname, str) or not isinstance(prop, dict):
            raise TypeError(f"{where}: property {pname!r} must be a str name with a dict schema")
        pdesc = prop.get("description", "")
        if not isinstance(pdesc, str):
            raise TypeError(f"{where}: property {pname!r} description must be a str")
        params.append(Param(pname, _param_type(pname, where, prop), pdesc, pname in required, prop.get("default")))
    return FunctionTool(name, description, tuple(params))


def check_tools(tools: object) -> tuple[list[str], list[FunctionTool]]:
    """Validate a ``tools`` list; returns (built-in tool names, custom functions), in order.

    Raises ``TypeError``/``ValueError`` saying which tool is wrong and how.
    """
    if not isinstance(tools, (list, tuple)):
        raise TypeError("tools must be a list of built-in tool names and function definitions, "
                        f"got {type(tools).__name__}")
    builtin: list[str] = []
    custom: list[FunctionTool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if isinstance(tool, str):
            if tool not in BUILTIN_TOOLS:
                raise ValueError(f"{where}: {tool!r} is not a built-in tool; they are {', '.join(BUILTIN_TOOLS)}")
            name = tool
            builtin.append(tool)
        elif isinstance(tool, dict):
            fn = _function_tool(tool, where)
            name = fn.name
            custom.append(fn)
        else:
            raise TypeError(f"{where} must be a built-in tool name (str) or a function definition (dict), "
                            f"got {type(tool).__name__}")
        if name in seen:
            raise ValueError(f"{where}: the tool {name!r} is listed twice")
        seen.add(name)
    return builtin, custom


def declared_tool_names(tools: Optional[Sequence[object]]) -> frozenset[str]:
    """The names of the tools a chat call declares (built-ins by name, functions by theirs):
    the only ones a reply may call.  Raises as :func:`check_tools` for a bad list."""
    if not tools:
        return frozenset()
    builtin, functions = check_tools(tools)
    return frozenset(builtin) | {f.name for f in functions}


# --- the templates ----------------------------------------------------------------------


def _tojson(value: Any) -> str:
    """Jinja's ``tojson`` filter: sorted keys, and <, >, & and ' escaped."""
    text = json.dumps(value, sort_keys=True)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("'", "\\u0027")):
        text = text.replace(ch, esc)
    return text


def _jinja_str(value: Any) -> str:
    """A value as Jinja prints ``{{ value }}``."""
    return str(value)


def environment_prompt(builtin: Sequence[str], has_custom: bool) -> str:
    """``Environment: ipython`` and the ``Tools:`` line (llama-models' ``BuiltinToolGenerator``)."""
    if not builtin and not has_custom:
        return ""
    named = [t for t in builtin if t != "code_interpreter"]
    return "Environment: ipython\n" + ("Tools: " + ", ".join(named) if named else "")


def dates_prompt(today: datetime.date) -> str:
    """The knowledge and today dates (llama-models' ``SystemDefaultGenerator``)."""
    return f"Cutting Knowledge Date: {KNOWLEDGE_CUTOFF}\nToday Date: {format_today(today)}"


def json_functions_prompt(functions: Sequence[FunctionTool]) -> str:
    """Custom functions declared in JSON (llama-models' ``JsonCustomToolGenerator``)."""
    out = [
        "Answer the user's question by making use of the following functions if needed.\n"
        "If none of the function can be used, please say so.\n"
        "Here is a list of functions in JSON format:\n"
    ]
    for fn in functions:
        props = ",".join(
            "\n                {\n"
            f'                    "{p.name}": {{\n'
            '                        "type": "object",\n'
            f'                        "description": "{p.description}"\n'
            "                    }\n"
            "                }"
            for p in fn.params
        )
        out.append(
            "{\n"
            '    "type": "function",\n'
            '    "function": {\n'
            f'        "name": "{fn.name}",\n'
            f'        "description": "{fn.description}",\n'
            '        "parameters": {\n'
            '            "type": "object",\n'
            f'            "properties": [{props}\n'
            "            ],\n"
            f'            "required": {_tojson([p.name for p in fn.params if p.required])}\n'
            "        }\n"
            "    }\n"
            "}\n"
        )
    out.append("\nReturn function calls in JSON format.")
    return "".join(out)


def function_tag_prompt(functions: Sequence[FunctionTool]) -> str:
    """Custom functions declared for ``<function=...>`` calls (llama-models'
    ``FunctionTagCustomToolGenerator``)."""
    out = ["You have access to the following functions:\n\n"]
    for fn in functions:
        params = {p.name: {"description": p.description, "param_type": p.param_type,
                           "required": p.required} for p in fn.params}
        out.append(
            f"Use the function '{fn.name}' to '{fn.description}':\n"
            f'{{"name": "{fn.name}", "description": "{fn.description}", "parameters": {_tojson(params)}}}\n\n'
        )
    out.append(
        "Think very carefully before calling functions.\n"
        "If you choose to call a function ONLY reply in the following format with no prefix or suffix:\n\n"
        '<function=example_function_name>{"example_name": "example_value"}</function>\n\n'
        "Reminder:\n"
        "- If looking for real time information use relevant functions before falling back to brave_search\n"
        "- Function calls MUST follow the specified format, start with <function= and end with </function>\n"
        "- Required parameters MUST be specified\n"
        "- Only call one function at a time\n"
        "- Put the entire function call reply on one line"
    )
    return "".join(out)


PYTHON_LIST_INTRO = (
    "You are an expert in composing functions. You are given a question and a set of possible functions.\n"
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the function can be used, point it out. "
    "If the given question lacks the parameters required by the function,\n"
    "also point it out. You should only return the function call in tools call sections.\n\n"
)


def _python_list_function(fn: FunctionTool) -> str:
    """One function as the pythonic-list prompts (Llama 3.2/3.3 and 4) declare it."""

    def prop(p: Param) -> str:
        default = f',\n                    "default": "{_jinja_str(p.default)}"' if p.default else ""
        return (
            f'\n                "{p.name}": {{\n'
            f'                    "type": "{p.param_type}",\n'
            f'                    "description": "{p.description}"{default}\n'
            "                }"
        )

    return (
        "{\n"
        f'        "name": "{fn.name}",\n'
        f'        "description": "{fn.description}",\n'
        '        "parameters": {\n'
        '            "type": "dict",\n'
        f'            "required": {_tojson([p.name for p in fn.params if p.required])},\n'
        f'            "properties": {{{",".join(prop(p) for p in fn.params)}\n'
        "            }\n"
        "        }\n"
        "    }"
    )


def _python_list_functions(functions: Sequence[FunctionTool]) -> str:
    return "[\n    " + ",\n    ".join(_python_list_function(fn) for fn in functions) + "\n]"


def python_list_prompt(functions: Sequence[FunctionTool]) -> str:
    """Custom functions declared for ``[f(a=1), ...]`` calls (llama-models'
    ``PythonListCustomToolGenerator`` with its default system prompt)."""
    return (
        PYTHON_LIST_INTRO
        + "If you decide to invoke any of the function(s), you MUST put it in the format of "
        "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
        "You SHOULD NOT include any other text in the response.\n\n"
        "Here is a list of functions in JSON format that you can invoke.\n\n" + _python_list_functions(functions)
    )


# Llama 4's system prompt for custom functions (its prompt format's "zero shot function calling -
# system message", llama-stack's Llama 4 PythonListCustomToolGenerator).
LLAMA4_TOOLS_INTRO = """\
You are a helpful assistant and an expert in function composition. You can answer general questions using \
your internal knowledge OR invoke functions when necessary. Follow these strict guidelines:

1. FUNCTION CALLS:
- ONLY use functions that are EXPLICITLY listed in the function list below
- If NO functions are listed (empty function list []), respond ONLY with internal knowledge or \
"I don't have access to [Unavailable service] information"
- If a function is not in the list, respond ONLY with internal knowledge or \
"I don't have access to [Unavailable service] information"
- If ALL required parameters are present AND the query EXACTLY matches a listed function's purpose: \
output ONLY the function call(s)
- Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]
Examples:
CORRECT: [get_weather(location="Vancouver"), calculate_route(start="Boston", end="New York")] \
<- Only if get_weather and calculate_route are in function list
INCORRECT: get_weather(location="New York")
INCORRECT: Let me check the weather: [get_weather(location="New York")]
INCORRECT: [get_events(location="Singapore")] <- If function not in list

2. RESPONSE RULES:
- For pure function requests matching a listed function: ONLY output the function call(s)
- For knowledge questions: ONLY output text
- For missing parameters: ONLY request the specific missing parameters
- For unavailable services (not in function list): output ONLY with internal knowledge or \
"I don't have access to [Unavailable service] information". Do NOT execute a function call.
- If the query asks for information beyond what a listed function provides: output ONLY with internal \
knowledge about your limitations
- NEVER combine text and function calls in the same response
- NEVER suggest alternative functions when the requested service is unavailable
- NEVER create or invent new functions not listed below

3. STRICT BOUNDARIES:
- ONLY use functions from the list below - no exceptions
- NEVER use a function as an alternative to unavailable information
- NEVER call functions not present in the function list
- NEVER add explanatory text to function calls
- NEVER respond with empty brackets
- Use proper Python/JSON syntax for function calls
- Check the function list carefully before responding

4. TOOL RESPONSE HANDLING:
- When receiving tool responses: provide concise, natural language responses
- Don't repeat tool response verbatim
- Don't add supplementary information

"""


def llama4_functions_prompt(functions: Sequence[FunctionTool]) -> str:
    """Custom functions declared to Llama 4, which calls them as ``[f(a=1), g(b=2)]``."""
    return (LLAMA4_TOOLS_INTRO + "Here is a list of functions in JSON format that you can invoke:\n"
            + _python_list_functions(functions))


def apply_llama4_tools(dialog: Sequence[dict], tools: Optional[Sequence[object]]) -> list[dict]:
    """The dialog with ``tools`` (custom functions only) declared as Llama 4 expects them: a
    system message holding :func:`llama4_functions_prompt`, your system message after it."""
    if not isinstance(dialog, (list, tuple)):
        raise TypeError(f"a dialog must be a list of messages, got {type(dialog).__name__}")
    messages = list(dialog)
    if not tools:
        return messages
    builtin, custom = check_tools(tools)
    if builtin:
        raise ValueError(f"Llama 4 is declared custom functions only, not built-in tools ({', '.join(builtin)}): "
                         "describe what you need as a function")
    system = ""
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        system = messages.pop(0).get("content", "")
        if not isinstance(system, str):
            raise TypeError(f"message 0 content must be a str, got {type(system).__name__}")
    content = llama4_functions_prompt(custom) + ("\n" + system if system else "")
    return [{"role": "system", "content": content}] + messages


# --- the entry point --------------------------------------------------------------------


def apply_tools(
    dialog: Sequence[Mapping[str, Any]],
    tools: Optional[Sequence[object]],
    tool_prompt_format: ToolPromptFormat = "json",
    today: Optional[datetime.date] = None,
) -> list[dict]:
    """The dialog with ``tools`` declared as Llama 3.1+ expects them (see the module doc).

    ``tool_prompt_format``: ``"json"`` (Llama 3.1's default), ``"function_tag"`` (3.1)
    or ``"python_list"`` (3.2, 3.3).  ``today``: the date the 3.1 system prompt gives
    (default: the local date).  A first ``system`` message is folded into the prompt;
    the other messages follow unchanged.  Without tools the dialog is returned as is.
    Encode the result with the same ``tool_prompt_format`` so that earlier tool calls
    are written back in the declared form.
    """
    if tool_prompt_format not in TOOL_PROMPT_FORMATS:
        raise ValueError(f"tool_prompt_format must be one of {TOOL_PROMPT_FORMATS}, got {tool_prompt_format!r}")
    if today is not None and not isinstance(today, datetime.date):
        raise TypeError(f"today must be a datetime.date, got {type(today).__name__}")
    if not isinstance(dialog, (list, tuple)):
        raise TypeError(f"a dialog must be a list of messages, got {type(dialog).__name__}")
    messages = list(dialog)
    if tools is None:
        return messages
    builtin, custom = check_tools(tools)
    if not builtin and not custom:
        return messages
    system = ""
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        system = messages.pop(0).get("content", "")
        if not isinstance(system, str):
            raise TypeError(f"message 0 content must be a str, got {type(system).__name__}")

    if tool_prompt_format == "python_list":
        content = ""
        if builtin:
            content += environment_prompt(builtin, False) + "\n"
        if custom:
            content += python_list_prompt(custom) + "\n"
        content += system
        return [{"role": "system", "content": content.strip("\n")}] + messages

    # Llama 3.1: as llama-models' LLama31Interface.system_messages.
    content = environment_prompt(builtin, bool(custom)) + "\n"
    content += dates_prompt(today or datetime.date.today())
    if system:
        content += "\n\n" + system
    content += "\n"
    out = [{"role": "system", "content": content}]
    if custom:
        declare = json_functions_prompt if tool_prompt_format == "json" else function_tag_prompt
        out.append({"role": "user", "content": declare(custom)})
    return out + messages
