"""No grammar or schema can crash the process (llama.structured.limits): what llguidance's
compiler would recurse into too deeply is measured and refused before it is compiled; schema
keywords llguidance would ignore are refused; the server's compiled grammars are kept per
tenant and per exact format.

The measures are checked against brute force on small random grammars and schemas (every
chain the compiler could follow, enumerated); the bounds with chains generated near and past
them, measured here and compiled in a worker process (tests/grammar_limits_worker.py: each
compile in a child of its own, so that a regression kills a child, which the test reports,
never the test run), directly and through the server's app.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers
from llama.structured import GrammarTokenizer, compile_response_format, tool_call_grammar
from llama.structured.limits import (
    MAX_GRAMMAR_DEPTH,
    MAX_GRAMMAR_TOKENS,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_NODES,
    PROPERTIES_PER_LEVEL,
    check_grammar_limits,
    check_schema_limits,
    lark_depth,
    schema_depth,
)
from llama.tokenizer import load_tokenizer

HYPOTHESIS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# For examples that measure chains of some hundred definitions.
CHAINS = settings(HYPOTHESIS, max_examples=30)

# -- the shapes -------------------------------------------------------------------------------
# Chains whose depth (as the module doc defines it) is worked out here by hand.


def rule_chain(n: int, groups: int = 0, terminals: bool = False) -> str:
    """``start`` and n definitions each naming the next inside ``groups`` groups, and a last one:
    depth 1 + n (1 + groups) + 1."""
    name = "T" if terminals else "r"
    lines = [f"start: {name}0"]
    lines += [f'{name}{i}: "a" {"(" * groups}{name}{i + 1}{")" * groups}' for i in range(n)]
    lines.append(f'{name}{n}: "b"')
    return "\n".join(lines)


def rule_chain_depth(n: int, groups: int = 0) -> int:
    return 2 + n * (1 + groups)


def lark_shape(kind: str, groups: int, n: int) -> tuple[str, int]:
    """A grammar of one of the kinds that recurse (chains of rules or terminals, within groups;
    a ``%if`` condition or template arguments nested n deep), and its depth worked out by hand."""
    if kind in ("rules", "terminals"):
        return rule_chain(n, groups, terminals=kind == "terminals"), rule_chain_depth(n, groups)
    if kind == "condition":  # start (1) + r (1 + n parentheses)
        return 'start: r::0\nr::_: "a" %if ' + "not(" * n + "true" + ")" * n + ' | "b"', 2 + n
    return 'start: "b" | ' + "x{" * n + '"a"' + "}" * n, 1 + n  # template arguments: start (1 + n braces)


# One link of a chain of $defs, each leading to the next ("#/$defs/d{i+1}") through some
# keyword, and the objects and arrays each link adds to the depth.
LINKS = {
    "alias": (lambda ref: {"$ref": ref}, 1),
    "properties": (lambda ref: {"type": "object", "properties": {"x": {"$ref": ref}}}, 3),
    "items": (lambda ref: {"type": "array", "items": {"$ref": ref}}, 2),
    "additionalProperties": (lambda ref: {"type": "object", "additionalProperties": {"$ref": ref}}, 2),
    "prefixItems": (lambda ref: {"type": "array", "prefixItems": [{"$ref": ref}]}, 3),
    "anyOf": (lambda ref: {"anyOf": [{"$ref": ref}, {"type": "null"}]}, 3),
    "allOf": (lambda ref: {"allOf": [{"$ref": ref}]}, 3),
    "sibling": (lambda ref: {"type": "object", "properties": {"x": {"$ref": ref, "type": "object"}}}, 3),
}


def ref_chain(n: int, link: str) -> dict:
    """A schema that $refs the first of n links, the last leading to a leaf: depth
    1 (root) + 1 ($defs) + n x the link's + 1 (the leaf)."""
    make, _ = LINKS[link]
    defs = {f"d{i}": make(f"#/$defs/d{i + 1}") for i in range(n)}
    defs[f"d{n}"] = {"type": "object"} if link == "sibling" else {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def ref_chain_depth(n: int, link: str) -> int:
    return 3 + n * LINKS[link][1]


def wide_object(n: int) -> dict:
    """An object of n properties: depth 1 + n // PROPERTIES_PER_LEVEL (their sequence is put
    together by one recursion a property), at least 3 (the object, its properties, one)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def wide_object_depth(n: int) -> int:
    return max(3 if n else 1, 1 + n // PROPERTIES_PER_LEVEL)


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def tool_chain(n: int, link: str) -> dict:
    """Parameters whose one property $refs a chain: depth 3 (root, properties, the property) +
    n x the link's + 1."""
    defs = ref_chain(n, link)["$defs"]
    return tool({"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "$defs": defs})


def largest(depth, limit: int) -> int:
    """The largest n with depth(n) <= limit."""
    n = 0
    while depth(n + 1) <= limit:
        n += 1
    return n


# -- the measures against brute force -----------------------------------------------------------


def heaviest_simple_path(weights: list[int], uses: list[list[int]]) -> int:
    """Every path that visits no node twice, enumerated: the heaviest (the sum of its weights)."""
    best = 0

    def walk(v: int, seen: frozenset, total: int) -> None:
        nonlocal best
        best = max(best, total)
        for w in uses[v]:
            if w not in seen:
                walk(w, seen | {w}, total + weights[w])

    for v in range(len(weights)):
        walk(v, frozenset({v}), weights[v])
    return best


def is_acyclic(uses: list[list[int]]) -> bool:
    state = [0] * len(uses)

    def visit(v: int) -> bool:
        state[v] = 1
        for w in uses[v]:
            if state[w] == 1 or (state[w] == 0 and not visit(w)):
                return False
        state[v] = 2
        return True

    return all(state[v] or visit(v) for v in range(len(uses)))


# Text that names definitions and opens groups without doing so, for the lexer to see through.
DECOYS = ['"(( n0 [ N1"', r"/n0\/ ( [/", "%json {\"n1\": \"((\", \"$ref\": \"#\"}", '"n2"i', "<|eot|>"]


@st.composite
def lark_grammars(draw):
    """A random grammar of 1-6 definitions (rules or terminals) naming one another within
    groups, with decoys and comments; its weights (1 + deepest group of a name) and edges."""
    k = draw(st.integers(1, 6))
    names = [("N" if draw(st.booleans()) else "n") + str(i) for i in range(k)]
    weights, uses, lines = [], [], []
    for i in range(k):
        refs = draw(st.lists(st.tuples(st.integers(0, k - 1), st.integers(0, 3), st.booleans()), max_size=3))
        alternatives = ['"x"']
        for j, depth, square in refs:
            open_, close = ("[", "]") if square else ("(", ")")
            alternatives.append(open_ * depth + f'"y" {names[j]}' + close * depth)
        alternatives.append(draw(st.sampled_from(DECOYS)))
        body = "\n  | ".join(alternatives) if draw(st.booleans()) else " | ".join(alternatives)
        lines.append(f"{names[i]}: {body}" + draw(st.sampled_from(["", "  // n0 ( N1", "  # (( n1"])))
        weights.append(1 + max((d for _, d, _ in refs), default=0))
        uses.append([j for j, _, _ in refs])
    return "\n".join(lines), weights, uses


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@HYPOTHESIS
@given(lark_grammars())
def test_lark_depth_bounds_every_chain_of_definitions(grammar):
    """At least the heaviest chain of distinct definitions (every chain the compiler could be
    in at once), and exactly it where no definitions name one another in a cycle."""
    text, weights, uses = grammar
    depth, _ = lark_depth(text)
    brute = heaviest_simple_path(weights, uses)
    assert depth >= brute
    if is_acyclic(uses):
        assert depth == brute


def spellings(j: int) -> list[str]:
    """Ways of writing a $ref to definition j (llguidance compiles a target once per way)."""
    return [f"#/$defs/d{j}", f"#/%24defs/d{j}"]


@st.composite
def schemas_with_refs(draw):
    """A schema with 1-4 definitions, each a small random tree of objects, arrays and
    alternatives whose leaves may $ref a definition (in one of two spellings)."""
    k = draw(st.integers(1, 4))

    def tree(depth: int):
        choice = draw(st.integers(0, 4 if depth < 3 else 1))
        if choice == 0:
            return {"type": "integer"}
        if choice == 1:
            return {"$ref": draw(st.sampled_from([s for j in range(k) for s in spellings(j)]))}
        if choice == 2:
            return {"type": "object", "properties": {f"p{i}": tree(depth + 1) for i in range(draw(st.integers(1, 2)))}}
        if choice == 3:
            return {"type": "array", "items": tree(depth + 1)}
        return {"anyOf": [tree(depth + 1), tree(depth + 1)]}

    defs = {f"d{j}": tree(0) for j in range(k)}
    return {"type": "object", "properties": {"a": tree(1)}, "$defs": defs}


def longest_walk(schema: dict) -> tuple[int, bool]:
    """Every walk from the root that goes into an object or array, or follows a $ref in a
    spelling not yet followed on the walk, enumerated: the most objects and arrays on one; and
    whether $refs can lead back to where they were followed from (a cycle)."""
    defs = schema["$defs"]

    def target(ref: str):
        return defs[ref.replace("%24", "$").rsplit("/", 1)[1]]

    best = 0

    def walk(node, used: frozenset, count: int) -> None:
        nonlocal best
        best = max(best, count)
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, (dict, list)):
                walk(child, used, count + 1)
        ref = node.get("$ref") if isinstance(node, dict) else None
        if ref is not None and ref not in used:
            walk(target(ref), used | {ref}, count + 1)

    walk(schema, frozenset(), 1)
    names = sorted(defs)
    found = {name: set() for name in names}

    def refs_in(node, into: set) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                into.add(node["$ref"].replace("%24", "$").rsplit("/", 1)[1])
            for v in node.values():
                refs_in(v, into)
        elif isinstance(node, list):
            for v in node:
                refs_in(v, into)

    for name in names:
        refs_in(defs[name], found[name])
    acyclic = is_acyclic([[names.index(m) for m in found[name]] for name in names])
    return best, not acyclic


@HYPOTHESIS
@given(schemas_with_refs())
def test_schema_depth_bounds_every_walk_through_refs(schema):
    depth = schema_depth(schema)
    brute, cyclic = longest_walk(schema)
    assert depth >= brute
    if not cyclic:
        assert depth == brute


def test_a_ref_that_cannot_be_followed_here_counts_as_leading_anywhere():
    """An anchor, another document, or anything under a nested $id: a cycle through it all."""
    chain = ref_chain(5, "items")
    followed = schema_depth(chain)
    for ref in ("#anchor", "other.json#/$defs/d0", "#/$defs/missing"):
        odd = {**chain, "$defs": {**chain["$defs"], "d5": {"$ref": ref}}}
        assert schema_depth(odd) > followed
    nested_id = {**chain, "$defs": {**chain["$defs"], "d5": {"$id": "http://x/y", "type": "integer"}}}
    assert schema_depth(nested_id) > followed


# -- the bounds, measured (no compiling here) -----------------------------------------------------

LARK_SHAPES = [("rules", g) for g in range(4)] + [("terminals", g) for g in range(4)] + [("condition", 0),
                                                                                       ("template", 0)]


@CHAINS
@given(st.sampled_from(LARK_SHAPES), st.integers(0, 3), st.booleans())
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_lark_chains_near_and_past_the_bound(shape, offset, past):
    kind, groups = shape
    n = largest(lambda m: lark_shape(kind, groups, m)[1], MAX_GRAMMAR_DEPTH)
    n = n + 1 + offset if past else n - offset
    text, depth = lark_shape(kind, groups, n)
    assert lark_depth(text)[0] == depth
    if not past:
        check_grammar_limits(text, "response_format.grammar")
        return
    with pytest.raises(ValueError, match=rf"^response_format\.grammar: .* more than the {MAX_GRAMMAR_DEPTH} allowed "
                                         r"\(MAX_GRAMMAR_DEPTH\)"):
        check_grammar_limits(text, "response_format.grammar")


@CHAINS
@given(st.sampled_from(sorted(LINKS)), st.integers(0, 3), st.booleans(), st.booleans())
def test_schema_chains_near_and_past_the_bound(link, offset, past, in_tools):
    n = largest(lambda m: ref_chain_depth(m, link), MAX_SCHEMA_DEPTH)
    n = n + 1 + offset if past else n - offset
    schema = ref_chain(n, link)
    assert schema_depth(schema) == ref_chain_depth(n, link)
    # The same chain as llguidance receives it: a schema, or a tool grammar's %json value.
    source = json.dumps({"grammars": [{"json_schema": schema}]})
    if in_tools:
        source = "start: %json " + json.dumps(schema)
    if not past:
        check_grammar_limits(source, "tools")
        check_schema_limits(schema, "tools")
        return
    for check in (lambda: check_grammar_limits(source, "tools"), lambda: check_schema_limits(schema, "tools")):
        with pytest.raises(ValueError, match=rf"^tools: .* more than the {MAX_SCHEMA_DEPTH} allowed "
                                             r"\(MAX_SCHEMA_DEPTH\)"):
            check()


@CHAINS
@given(st.integers(0, 7), st.booleans())
def test_objects_of_many_properties_near_and_past_the_bound(offset, past):
    n = largest(wide_object_depth, MAX_SCHEMA_DEPTH) - offset
    n = n + PROPERTIES_PER_LEVEL if past else n
    assert schema_depth(wide_object(n)) == wide_object_depth(n)
    if not past:
        check_schema_limits(wide_object(n), "response_format")
        return
    with pytest.raises(ValueError, match=r"MAX_SCHEMA_DEPTH"):
        check_schema_limits(wide_object(n), "response_format")
    with pytest.raises(ValueError, match=r"MAX_SCHEMA_DEPTH"):  # the same, under a $ref
        check_schema_limits({"$ref": "#/$defs/w", "$defs": {"w": wide_object(n)}}, "response_format")


def test_the_reported_crashes_are_refused_before_llguidance():
    """The shapes that crashed: 3,000 rules (58 KB), 1,000 $defs (94 KB), the same in a tool."""
    with pytest.raises(ValueError, match="MAX_GRAMMAR_DEPTH"):
        check_grammar_limits(rule_chain(3000), "response_format.grammar")
    for schema in (ref_chain(1000, "properties"), tool_chain(1000, "properties")["function"]["parameters"]):
        with pytest.raises(ValueError, match="MAX_SCHEMA_DEPTH"):
            check_schema_limits(schema, "response_format")


def test_a_cycle_counts_in_full():
    """Definitions that name one another in a cycle may each be met once before any again."""
    n = MAX_GRAMMAR_DEPTH
    cycle = "start: r0\n" + "\n".join(f'r{i}: "a" r{(i + 1) % n} | "b"' for i in range(n))
    assert lark_depth(cycle)[0] == n + 1
    with pytest.raises(ValueError, match="MAX_GRAMMAR_DEPTH"):
        check_grammar_limits(cycle, "response_format.grammar")
    recursive = {"$ref": "#/$defs/tree", "$defs": {"tree": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/tree"}}}}}}
    assert schema_depth(recursive) <= 10
    check_schema_limits(recursive, "response_format")


def test_sizes_past_what_measuring_may_cost_are_refused():
    many = "start: " + " | ".join(f'"w{i}"' for i in range(MAX_GRAMMAR_TOKENS // 2 + 1))
    with pytest.raises(ValueError, match="MAX_GRAMMAR_TOKENS"):
        check_grammar_limits(many, "response_format.grammar")
    wide = {"type": "array", "default": [[] for _ in range(MAX_SCHEMA_NODES)]}
    with pytest.raises(ValueError, match="MAX_SCHEMA_NODES"):
        check_schema_limits(wide, "response_format")


def test_lark_the_lexer_cannot_read_is_refused():
    with pytest.raises(ValueError, match="cannot be read at line 2"):
        check_grammar_limits('start: "a"\nstart2: $', "response_format.grammar")


# -- schema keywords --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_tiktoken_path) -> GrammarTokenizer:
    return GrammarTokenizer(load_tokenizer(tiny_tiktoken_path))


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


# Every keyword llguidance implements, and annotations: all still compile.
EVERY_KEYWORD = {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "title": "t", "description": "d",
    "type": "object", "required": ["a"], "additionalProperties": False,
    "properties": {
        "a": {"type": "string", "minLength": 1, "maxLength": 5, "pattern": "^[a-z]+$", "default": "x",
              "examples": ["y"], "deprecated": False, "readOnly": True, "$comment": "c"},
        "b": {"type": "integer", "minimum": 0, "maximum": 10, "multipleOf": 2},
        "c": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "d": {"type": "array", "prefixItems": [{"const": 1}], "items": {"enum": [2, 3]}, "minItems": 1, "maxItems": 3},
        "e": {"anyOf": [{"$ref": "#/$defs/f"}, {"type": "null"}]},
        "f": {"oneOf": [{"type": "boolean"}, {"type": "string", "format": "date"}]},
        "g": {"allOf": [{"type": "object", "patternProperties": {"^x": {"type": "integer"}}}]},
        "h": {"type": "object", "properties": {"k": {}}, "required": ["k"], "minProperties": 1, "maxProperties": 1},
    },
    "$defs": {"f": {"type": "string"}},
}


def test_every_supported_keyword_still_compiles(tiny):
    compile_response_format(json_schema(EVERY_KEYWORD), tiny)
    readme = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "score": {"type": "integer"}},
              "required": ["colour", "score"], "additionalProperties": False}
    compile_response_format(json_schema(readme), tiny)
    compile_response_format(json_schema({"type": "object", "x-guidance": {"whitespace_flexible": False}}), tiny)


@pytest.mark.parametrize("schema, where, says", [
    ({"type": "object", "nullable": True}, "schema", "'nullable' is not a keyword"),
    ({"type": "object", "properties": {"a": {"type": "array", "maxItem": 3}}}, "schema.properties.a", "'maxItem'"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "string", "discriminator": {}}}}, "schema.$defs.a", "discriminator"),
    ({"anyOf": [{"type": "string"}, {"type": "integer", "not": {"const": 3}}]}, "schema.anyOf[1]", "'not'"),
    ({"type": "object", "properties": {"a": {"x-guidance": {}}}}, "schema.properties.a", "only at the top"),
    ({"type": "object", "x-guidance": "abc"}, "schema.x-guidance", "must be an object"),
    ({"type": "object", "x-guidance": 5}, "schema.x-guidance", "must be an object"),
])
def test_a_keyword_llguidance_would_ignore_is_refused(tiny, schema, where, says):
    with pytest.raises(ValueError) as e:
        compile_response_format(json_schema(schema), tiny)
    assert str(e.value).startswith(f"response_format.json_schema.{where}") and says in str(e.value), str(e.value)


def test_lenient_mode_asked_for_ignores_unsupported_keywords(tiny):
    compile_response_format(json_schema({"type": "object", "nullable": True, "x-guidance": {"lenient": True}}), tiny)


@pytest.mark.parametrize("options", ["abc", [1], 5])
def test_a_tool_s_x_guidance_that_is_no_object_is_a_value_error(tiny, options):
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.parameters\.x-guidance must be an object"):
        tool_call_grammar([tool({"type": "object", "x-guidance": options})], "required", tiny)


def test_a_tool_s_unknown_keyword_is_a_value_error(tiny):
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.parameters\.properties\.a: 'nullable'"):
        tool_call_grammar([tool({"type": "object", "properties": {"a": {"type": "string", "nullable": True}}})],
                          "required", tiny)


# -- the server: errors, and its cache of compiled grammars ----------------------------------------

KEYS = ["key-of-alice", "key-of-bob"]


@pytest.fixture
def served(tiny_tiktoken_path, monkeypatch):
    from fastapi.testclient import TestClient

    from fake_engine import FakeEngine, served_model
    from llama.formats.chat import chat_format_for
    from llama.serve import create_app

    tokenizer = load_tokenizer(tiny_tiktoken_path)
    engine = FakeEngine(tokenizer, max_batch_size=2, max_seq_len=4096)
    compiled = []  # the formats compiled (not found kept), in order
    llama = served_model(engine, chat_format_for(tokenizer))
    real = compile_response_format

    def counting(response_format, tokenizer):
        compiled.append(response_format)
        return real(response_format, tokenizer)

    monkeypatch.setattr("llama.structured.manager.compile_response_format", counting)
    with TestClient(create_app(llama, "tiny", api_keys=KEYS)) as client:
        yield client, engine, compiled
    engine.close()


def chat(client, key: str, **body):
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})


def check_400(r, param: str, says: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_the_server_refuses_what_llguidance_would_ignore_with_a_400(served):
    client, engine, _ = served
    check_400(chat(client, KEYS[0], response_format=json_schema({"type": "object", "x-guidance": "abc"})),
              "response_format", "x-guidance must be an object")
    check_400(chat(client, KEYS[0], response_format=json_schema({"type": "object", "foo": 1})),
              "response_format", "'foo' is not a keyword")
    check_400(chat(client, KEYS[0], tools=[tool({"type": "object", "x-guidance": "abc"})], tool_choice="required"),
              "tools", "tools[0].function.parameters.x-guidance must be an object")
    assert chat(client, KEYS[0]).status_code == 200


def test_properties_come_in_the_order_each_schema_asks(served):
    """Two schemas that differ only in the order of their properties are two grammars."""
    client, engine, _ = served
    grammars = []
    for order in (["zeta", "alpha"], ["alpha", "zeta"]):
        schema = {"type": "object", "properties": {p: {"type": "integer"} for p in order},
                  "required": ["alpha", "zeta"]}
        assert chat(client, KEYS[0], response_format=json_schema(schema)).status_code == 200
        grammar = engine.submitted[-1].settings.grammar
        source = json.loads(grammar.source)["grammars"][0]["json_schema"]
        assert list(source["properties"]) == order  # what llguidance compiled, in the order asked
        grammars.append(grammar)
    assert grammars[0] is not grammars[1]


def test_compiled_grammars_are_kept_per_tenant(served):
    """A format one key sent is compiled again for another key, or another cache_salt (no
    tenant can time another's formats), and kept for the same key."""
    client, engine, compiled = served
    fmt = json_schema({"type": "object", "properties": {"a": {"enum": [f"v{i}" for i in range(50)]}}})
    for key, salt in [(KEYS[0], None), (KEYS[0], None), (KEYS[1], None), (KEYS[1], "s1"), (KEYS[1], "s1")]:
        extra = {} if salt is None else {"cache_salt": salt}
        assert chat(client, key, response_format=fmt, **extra).status_code == 200
    assert len(compiled) == 3
    assert len({id(r.settings.grammar) for r in engine.submitted}) == 3


def test_tool_grammars_are_kept_per_tenant(served):
    client, engine, _ = served
    tools = [tool({"type": "object", "properties": {"city": {"type": "string"}}})]
    for key in (KEYS[0], KEYS[0], KEYS[1]):
        assert chat(client, key, tools=tools, tool_choice="required").status_code == 200
    grammars = [r.settings.grammar for r in engine.submitted]
    assert grammars[0] is grammars[1] and grammars[2] is not grammars[0]


# -- compiled where a crash cannot take the test run down (slow: a worker process) ---------------


class Worker:
    """tests/grammar_limits_worker.py, asked one request at a time."""

    def __init__(self, mode: str, tokenizer: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(helpers.REPO), str(helpers.REPO / "tests")]),
               "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "grammar_limits_worker.py"), mode,
                                      str(tokenizer)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=helpers.REPO)
        assert self._line(120) == "ready"

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            pytest.fail(f"the worker did not answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            pytest.fail(f"the worker died (exit status {self.proc.wait(10)}: a negative status is the signal)")
        return line.strip()

    def ask(self, request: dict, timeout: float = 180) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line(timeout))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def compiler(tiny_tiktoken_path):
    worker = Worker("compile", tiny_tiktoken_path)
    yield worker
    worker.close()


@pytest.mark.slow
def test_the_shapes_do_crash_llguidance_unchecked(compiler):
    """The harness sees a crash: unchecked, the reported shapes (three times as long, for
    the stack the worker's children have) kill their child (SIGSEGV)."""
    stack, _ = resource.getrlimit(resource.RLIMIT_STACK)
    if stack == resource.RLIM_INFINITY or stack > 64 << 20:
        pytest.skip(f"the stack may grow to {stack} bytes here: no chain of a reasonable size overflows it")
    scale = max(1.0, stack / (8 << 20))  # the crash depths were measured on 8 MiB
    rules, links = int(3 * 2700 * scale), int(3 * 940 * scale)
    shapes = [{"response_format": {"type": "grammar", "grammar": rule_chain(rules)}},
              {"response_format": json_schema(ref_chain(links, "properties"))},
              {"tools": [tool_chain(links, "properties")]}]
    for shape in shapes:
        answer = compiler.ask({**shape, "unchecked": True})
        assert answer["outcome"] == "signal" and answer["signal"] in (signal.SIGSEGV, signal.SIGBUS), answer


SLOW_HYPOTHESIS = settings(HYPOTHESIS, max_examples=40)


@pytest.mark.slow
@SLOW_HYPOTHESIS
@given(st.sampled_from(LARK_SHAPES), st.integers(0, 2), st.sampled_from(["below", "past", "far"]))
def test_lark_chains_near_and_past_the_bound_compile_or_are_refused(compiler, shape, offset, where):
    """Below the bound a grammar compiles (template arguments: llguidance's own error), past it
    and far past (as deep as what crashed llguidance) it is refused; nothing crashes."""
    kind, groups = shape
    n = largest(lambda m: lark_shape(kind, groups, m)[1], MAX_GRAMMAR_DEPTH)
    # Far past: as deep as what crashed (the conditions' and templates' cost least a level).
    far = 50 if kind in ("condition", "template") else 6
    n = {"below": n - offset, "past": n + 1 + offset, "far": far * n + offset}[where]
    answer = compiler.ask({"response_format": {"type": "grammar", "grammar": lark_shape(kind, groups, n)[0]}})
    if where == "below" and kind == "template":
        assert answer["outcome"] == "error" and "template usage not supported" in answer["message"], answer
    elif where == "below":
        assert answer == {"outcome": "ok"}, answer
    else:
        assert answer["outcome"] == "error" and "MAX_GRAMMAR_DEPTH" in answer["message"], answer
        assert answer["message"].startswith("response_format.grammar: ")


@pytest.mark.slow
@SLOW_HYPOTHESIS
@given(st.sampled_from(sorted(LINKS)), st.integers(0, 2), st.sampled_from(["below", "past", "far"]),
       st.sampled_from(["response_format", "json", "python_list"]))
def test_schema_chains_near_and_past_the_bound_compile_or_are_refused(compiler, link, offset, where, field):
    if field == "response_format":
        depth, build = ref_chain_depth, lambda m: {"response_format": json_schema(ref_chain(m, link))}
        prefix = "response_format.json_schema.schema: "
    else:
        depth = lambda m, link: ref_chain_depth(m, link) + 1  # noqa: E731  (root, properties, the property)
        build = lambda m: {"tools": [tool_chain(m, link)], "tool_prompt_format": field}  # noqa: E731
        prefix = "tools[0].function.parameters: "
    n = largest(lambda m: depth(m, link), MAX_SCHEMA_DEPTH)
    n = {"below": n - offset, "past": n + 1 + offset, "far": 6 * n + offset}[where]
    answer = compiler.ask(build(n))
    if where == "below":
        assert answer == {"outcome": "ok"}, answer
    else:
        assert answer["outcome"] == "error" and "MAX_SCHEMA_DEPTH" in answer["message"], answer
        assert answer["message"].startswith(prefix), answer


@pytest.mark.slow
@pytest.mark.parametrize("past", [False, True])
def test_an_object_of_as_many_properties_as_allowed_compiles(compiler, past):
    n = largest(wide_object_depth, MAX_SCHEMA_DEPTH) + (PROPERTIES_PER_LEVEL if past else 0)
    answer = compiler.ask({"response_format": json_schema(wide_object(n))})
    if past:
        assert answer["outcome"] == "error" and "MAX_SCHEMA_DEPTH" in answer["message"], answer
    else:
        assert answer == {"outcome": "ok"}, answer


@pytest.fixture(scope="module")
def server(compiler):
    """The compiling worker, whose requests with a path go to the server's app (in a child of its
    own, forked at the first: a crash there ends the worker, as it ends one of mode http)."""
    return compiler


@pytest.mark.slow
def test_the_server_answers_the_reported_crashes_with_400s_and_goes_on(server):
    message = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    bodies = [
        ({**message, "response_format": {"type": "grammar", "grammar": rule_chain(3000)}}, "response_format",
         "MAX_GRAMMAR_DEPTH"),
        ({**message, "response_format": json_schema(ref_chain(1000, "properties"))}, "response_format",
         "MAX_SCHEMA_DEPTH"),
        ({**message, "tools": [tool_chain(1000, "properties")], "tool_choice": "required"}, "tools",
         "MAX_SCHEMA_DEPTH"),
        ({**message, "tools": [tool({"type": "object", "x-guidance": "abc"})], "tool_choice": "required"}, "tools",
         "must be an object"),
    ]
    for path in ("/v1/chat/completions", "/v1/completions"):
        for body, param, says in bodies:
            if path == "/v1/completions":
                if "tools" in body:
                    continue
                body = {"prompt": "hi", **{k: v for k, v in body.items() if k != "messages"}}
            answer = server.ask({"path": path, "body": body})
            assert answer["status"] == 400 and answer["body"]["error"]["param"] == param, answer
            assert says in answer["body"]["error"]["message"], answer
    assert server.ask({"path": "/v1/chat/completions", "body": message})["status"] == 200
