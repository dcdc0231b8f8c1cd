"""llama.structured.manager.StructuredOutputs: the one place grammars are compiled and kept (the
engine only receives them), by exact JSON and tenant scope, the last few kept."""

from __future__ import annotations

import threading

import pytest

from llama.engine import Engine
from llama.structured import StructuredOutputs
from llama.tokenizer import load_tokenizer

REGEX = {"type": "regex", "regex": "[0-9]{3}"}
SCHEMA_AZ = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"alpha": {"type": "integer"}, "zeta": {"type": "integer"}}}}}
SCHEMA_ZA = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}}}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture
def counted(tiny_tiktoken_path, monkeypatch):
    """A manager (in-process compiles) and the list of formats it actually compiled."""
    import llama.structured.manager as manager

    compiled = []
    real = manager.compile_response_format

    def counting(response_format, tokenizer):
        compiled.append(response_format)
        return real(response_format, tokenizer)

    monkeypatch.setattr(manager, "compile_response_format", counting)
    return StructuredOutputs(load_tokenizer(tiny_tiktoken_path), compile_timeout_s=None, kept=2), compiled


def test_a_format_is_compiled_once_per_exact_json_and_scope(counted):
    structured, compiled = counted
    first = structured.response_format(REGEX)
    assert structured.response_format(dict(REGEX)) is first and len(compiled) == 1  # equal JSON: kept
    assert structured.response_format(REGEX, scope="key-b") is not first and len(compiled) == 2  # another tenant
    # the same properties in another order are another format (a reply's properties come in the schema's order)
    structured.response_format(SCHEMA_AZ)
    structured.response_format(SCHEMA_ZA)
    assert compiled[-2:] == [SCHEMA_AZ, SCHEMA_ZA]
    assert structured.response_format(None) is None


def test_the_last_few_are_kept_least_recently_used_first_out(counted):
    structured, compiled = counted  # kept=2
    a = structured.response_format(REGEX)
    structured.response_format(SCHEMA_AZ)
    assert structured.response_format(REGEX) is a  # used again: now the most recent
    structured.response_format(SCHEMA_ZA)  # evicts SCHEMA_AZ, the least recently used
    assert structured.response_format(REGEX) is a and len(compiled) == 3
    structured.response_format(SCHEMA_AZ)
    assert len(compiled) == 4


def test_a_format_that_fails_is_not_kept(counted):
    structured, compiled = counted
    bad = {"type": "regex", "regex": "("}
    for _ in range(2):
        with pytest.raises(ValueError, match="regex"):
            structured.response_format(bad)
    assert compiled == [bad, bad]


def test_tool_choices_are_kept_and_unconstrained_ones_compile_nothing(counted):
    structured, _ = counted
    assert structured.tool_choice(TOOLS, "auto") is None and structured.tool_choice(TOOLS, "none") is None
    required = structured.tool_choice(TOOLS, "required")
    assert required is not None and structured.tool_choice(TOOLS, "required") is required
    assert structured.tool_choice(TOOLS, "required", scope="other") is not required
    with pytest.raises(ValueError, match="tool_choice"):
        structured.tool_choice(TOOLS, {"type": "function", "function": {"name": "missing"}})


def test_threads_asking_for_one_format_all_get_a_grammar(counted):
    structured, _ = counted
    out, errors = [], []

    def ask():
        try:
            out.append(structured.response_format(SCHEMA_AZ))
        except Exception as e:  # pragma: no cover - the failure the test reports
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(out) == 8 and all(g is not None for g in out)
    assert structured.response_format(SCHEMA_AZ) in out  # one of them is the one kept


def test_the_engine_compiles_nothing():
    """Grammars reach the engine compiled (RequestSettings.grammar); compiling is the manager's job."""
    assert not [name for name in dir(Engine) if "compile_" in name or name == "grammar_tokenizer"]
