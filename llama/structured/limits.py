"""What a grammar or a JSON schema may be before llguidance sees it.

**Depth.**  llguidance compiles a grammar by recursion, and a deep enough recursion overflows
the thread's stack: the process dies (SIGSEGV), whatever called it.  What recurses as deep as
a client asks (read in llguidance's source, measured with 1.9.1, each shape in a process of
its own, on 8 MiB of stack, Linux's default; the crash depth moves in proportion to the stack):

* a Lark grammar's rules and terminals are compiled depth first, each the first time another
  names it, inside the groups that name it: a chain of rules each naming the next crashed at
  2,687 rules (3.1 KB of stack a rule), of terminals at 3,562, of rules each naming the next
  inside a group at 1,718;
* Lark's own parser recurses into what no limit of llguidance's bounds: ``%if`` conditions
  (``not(not(...))``: crashed at 23,750) and template arguments (``x{x{...}}``: between 10,000
  and 20,000);
* a JSON schema's ``$ref`` is compiled where it is met, inside the subschemas that hold it:
  ``{"type": "array", "items": {"$ref": <next>}}`` chained crashed at 1,093 definitions
  (2,189 nested objects from the root), ``{"$ref": <next>}`` at 2,500, objects whose
  properties ``$ref`` the next at 937 (2,814 nested objects and arrays), ten levels of
  properties between ``$ref``\\ s at 140 (2,943);
* an object's properties are put in sequence by a recursion of one call a property (some 350
  bytes): about 3,000 properties crashed on 1 MiB of stack (on 8 MiB it would take more than
  llguidance accepts).

The rest is bounded by llguidance itself: a Lark expression nests at most 30 groups and
``%lark`` blocks 30, a regex 250, a schema's JSON 128 levels (serde's limit), schema
intersections 128; repetitions (``x{1000}``) are factored (their depth is logarithmic);
grammars that name one another (``@name``) are linked without recursion; the lexer and the
Earley parser iterate.

So each grammar is measured before it is compiled, and refused past a bound, by
:func:`check_grammar_limits`:

* :func:`lark_depth`: the heaviest chain of definitions that name one another, each counted
  as 1 + the depth of brackets (``( )``, ``[ ]``, ``{ }``, a condition's parentheses
  included) within it; definitions that name one another in a cycle all count (the compiler
  may meet every one of them before it meets one again).  At most :data:`MAX_GRAMMAR_DEPTH`.
* :func:`schema_depth`: the longest chain of objects and arrays within one another from the
  schema's root, following every ``$ref`` to what it names; where ``$ref``\\ s form a cycle,
  every object and array of the cycle counts, once for each way of spelling a ``$ref`` to
  it (llguidance compiles a target once per spelling).  A ``$ref`` that cannot be followed
  here (an anchor, another document, or any reference under a nested ``$id``) may lead
  anywhere: it counts as a cycle through the whole schema.  An object's properties add a
  level for every :data:`PROPERTIES_PER_LEVEL` of them.  At most :data:`MAX_SCHEMA_DEPTH`.

Both bounds are about a fifth of the smallest crash depth measured on 8 MiB (so they hold on
threads of 2 MiB, the default where ``ulimit -s`` is unlimited, with a margin left); both
are upper bounds whatever order llguidance takes (a chain it never follows may be counted,
never the other way round), and far above what real grammars and schemas need.  Measuring
takes time in proportion to the text, bounded by :data:`MAX_GRAMMAR_TOKENS` and
:data:`MAX_SCHEMA_NODES`.

**Schema keywords.**  llguidance ignores keywords it does not know (a misspelt
``"maxItem"``, ``"nullable"``), so a schema would be enforced without them.
:func:`check_schema_keywords` refuses them, as docs/structured-output.md promises, keeping what llguidance
implements, the annotations, and ``x-guidance`` (llguidance's options, an object) at the
top of the schema.  ``"x-guidance": {"lenient": true}`` asks for llguidance's lenient mode,
in which unsupported keywords are ignored (and logged); then they are not refused here.

Everything here is pure Python (no llguidance, no torch): cheap to call before compiling.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Mapping, Optional, Sequence, cast
from urllib.parse import unquote

__all__ = [
    "MAX_GRAMMAR_DEPTH",
    "MAX_GRAMMAR_TOKENS",
    "MAX_SCHEMA_DEPTH",
    "MAX_SCHEMA_NODES",
    "PROPERTIES_PER_LEVEL",
    "SCHEMA_ANNOTATIONS",
    "SCHEMA_KEYWORDS",
    "check_grammar_limits",
    "check_schema_keywords",
    "check_schema_limits",
    "lark_depth",
    "schema_depth",
]

# The smallest crash depths measured (see the module doc): 2,689 (a chain of rules) and 2,189
# (array items chained by $ref), as lark_depth and schema_depth count.  About a fifth of them.
MAX_GRAMMAR_DEPTH = 512
MAX_SCHEMA_DEPTH = 400
# An object's properties are put in sequence by a recursion of their own (one call a property,
# about 350 bytes of stack): every so many count as one level more of the object.
PROPERTIES_PER_LEVEL = 8
# What measuring may cost (a fraction of a second, in Python): tokens of one Lark grammar,
# objects and arrays in one schema.  Far above real grammars and schemas (llguidance itself
# refuses a schema past 50,000 compiled subschemas).
MAX_GRAMMAR_TOKENS = 100_000
MAX_SCHEMA_NODES = 100_000

# -- the measures ------------------------------------------------------------------------------


def _longest_path(n: int, edges: Sequence[Sequence[int]], weight: Sequence[int], cyclic_weight: Sequence[int],
                  roots: Iterable[int]) -> int:
    """The heaviest path from any of ``roots`` in a directed graph of ``n`` nodes, where a node
    outside every cycle weighs ``weight[v]`` and a strongly connected component with a cycle
    (a self-loop included) weighs the sum of its nodes' ``cyclic_weight``.

    Tarjan's algorithm without recursion (its components come out in reverse topological
    order, so each one's heaviest path is known when it is emitted)."""
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    component = [-1] * n
    heaviest: list[int] = []  # per component: its weight plus the heaviest path after it
    stack: list[int] = []
    counter = 0
    best = 0
    for root in roots:
        if index[root] != -1:
            continue
        work = [(root, 0)]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        while work:
            v, i = work[-1]
            out = edges[v]
            if i < len(out):
                work[-1] = (v, i + 1)
                w = out[i]
                if index[w] == -1:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] != index[v]:
                continue
            members = []
            while True:
                w = stack.pop()
                on_stack[w] = False
                component[w] = len(heaviest)
                members.append(w)
                if w == v:
                    break
            c = len(heaviest)
            cyclic = len(members) > 1 or v in edges[v]
            own = sum(cyclic_weight[w] for w in members) if cyclic else weight[v]
            after = 0
            for w in members:
                for x in edges[w]:
                    if component[x] != c:
                        after = max(after, heaviest[component[x]])
            heaviest.append(own + after)
        best = max(best, heaviest[component[root]])
    return best


def schema_depth(schema: Any) -> int:
    """How deep llguidance's compiler may recurse into ``schema`` (a JSON value): the longest
    chain of objects and arrays within one another from the root, following ``$ref``\\ s
    (see the module doc).  ``schema`` must be plain JSON (dicts, lists, scalars), a tree.
    ValueError past :data:`MAX_SCHEMA_NODES` objects and arrays."""
    if not isinstance(schema, (dict, list)):
        return 0
    # Every object and array, numbered in a walk from the root (parents before children).
    nodes: list[Any] = []
    parent: list[int] = []
    level: list[int] = []
    refs: list[tuple[int, str]] = []  # (object, its "$ref")
    wide: list[tuple[int, int]] = []  # (object, levels its properties count as)
    nested_id = False
    draft4 = isinstance(schema, dict) and "draft-04" in str(schema.get("$schema", ""))
    todo = [(schema, -1)]
    while todo:
        value, up = todo.pop()
        k = len(nodes)
        if k >= MAX_SCHEMA_NODES:
            raise ValueError(f"the schema has more than {MAX_SCHEMA_NODES} objects and arrays (MAX_SCHEMA_NODES): "
                             "shorten it")
        nodes.append(value)
        parent.append(up)
        level.append(level[up] + 1 if up >= 0 else 1)
        if isinstance(value, dict):
            if isinstance(value.get("$ref"), str):
                refs.append((k, value["$ref"]))
            if isinstance(value.get("properties"), dict) and len(value["properties"]) >= PROPERTIES_PER_LEVEL:
                wide.append((k, len(value["properties"]) // PROPERTIES_PER_LEVEL))
            if k > 0 and (isinstance(value.get("$id"), str) or (draft4 and isinstance(value.get("id"), str))):
                nested_id = True
            todo.extend((v, k) for v in value.values() if isinstance(v, (dict, list)))
        else:
            todo.extend((v, k) for v in value if isinstance(v, (dict, list)))
    if not refs:  # a tree: its height
        return max(max(level), max((level[k] + extra for k, extra in wide), default=0))
    n = len(nodes)
    edges: list[list[int]] = [[] for _ in range(n)]
    for k in range(1, n):
        edges[parent[k]].append(k)
    # An object's properties are put in sequence by one recursion more: a path may end there.
    leaves: list[int] = []
    for k, extra in wide:
        edges[k].append(n + len(leaves))
        leaves.append(extra)
    n_leaves = len(leaves)
    # Where each distinct "$ref" leads: an object or array here, or None (anywhere).
    targets: dict[str, Optional[int]] = {}
    index_of = {id(v): k for k, v in enumerate(nodes)}
    for _, ref in refs:
        if ref not in targets:
            target = None if nested_id else _follow_pointer(schema, ref)
            targets[ref] = index_of.get(id(target)) if target is not None else None
    ref_node = {ref: n + n_leaves + j for j, ref in enumerate(targets)}
    anywhere = n + n_leaves + len(targets)
    total = anywhere + 1
    edges += [[] for _ in range(total - n)]
    for k, ref in refs:
        edges[k].append(ref_node[ref])
    # Each object or array is compiled once inline and once more for each spelling of a
    # $ref to it or to one of its ancestors; one that cannot be followed may lead anywhere.
    spellings = [0] * n
    unknown = 0
    for ref, target in targets.items():
        edges[ref_node[ref]].append(anywhere if target is None else target)
        if target is None:
            unknown += 1
        else:
            spellings[target] += 1
    if unknown:
        edges[anywhere] = list(range(n))
    above = [0] * n  # spellings of $refs to the node or its ancestors
    for k in range(n):
        above[k] = spellings[k] + (above[parent[k]] if parent[k] >= 0 else 0)
    weight = [1] * n + leaves + [0] * (total - n - n_leaves)
    cyclic_weight = [1 + unknown + a for a in above] + leaves + [0] * (total - n - n_leaves)
    return _longest_path(total, edges, weight, cyclic_weight, [0])


def _follow_pointer(document: Any, ref: str) -> Any:
    """What ``ref`` (``"#"`` or ``"#/a/b"``, a JSON pointer in a URI fragment) names in
    ``document``, or None."""
    if not ref.startswith("#"):
        return None
    pointer = unquote(ref[1:])
    if pointer == "":
        return document
    if not pointer.startswith("/"):
        return None  # an anchor
    node = document
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, (dict, list)) else None


# llguidance's Lark lexer (lark/lexer.rs): the same tokens, found the same way (each of its
# tokens is the longest match at its place; the alternatives here are ordered so that the
# first that matches is that one: a name before "_" and "?", a number before "+" and "->").
_LARK_TOKEN = re.compile(r"""
    [ \t]*
    (?:
      (?P<name>!?[_?]?[a-z][_a-z0-9\-]*|_?[A-Z][_A-Z0-9\-]*)
    | (?P<number>0[xX][0-9a-fA-F]+|[+-]?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)
    | (?P<string>"(?:\\(?:["\\/bfnrt]|u[a-fA-F0-9]{4}|x[a-fA-F0-9]{2})|[^"\\\x00-\x1f\x7f])*"i?)
    | (?P<punct>->|::|\.\.|[:,.(){}\[\]~|&=_+*?])
    | (?P<newline>(?:\r?\n)+[ \t]*)
    | (?P<comment>(?:\#|//)[^\n]*)
    | (?P<regexp>/(?:\\.|[^/\\])+/[imslux]*)
    | (?P<keyword>%(?:ignore|import|override|declare|json|regex|llguidance|if|lark))
    | (?P<other><[^<>\s]+>|@[a-zA-Z0-9_\-]+)
    )
""", re.VERBOSE)
_JSON_WHITESPACE = re.compile(r"[ \t\n\r]*")
_JSON_VALUED = ("%json", "%regex", "%llguidance")  # keywords a JSON value follows
_MAX_LARK_NESTING = 30  # llguidance's own limit on %lark { } blocks within one another


def _lark_tokens(text: str) -> tuple[list[tuple[str, str]], list[Any]]:
    """``text``'s tokens as (kind, text), and the JSON values that follow ``%json``.  ValueError
    where llguidance's lexer would fail too, or past :data:`MAX_GRAMMAR_TOKENS`."""
    tokens: list[tuple[str, str]] = []
    schemas: list[Any] = []
    decoder = json.JSONDecoder()
    text += "\n"  # as llguidance's lexer does
    pos, end = 0, len(text)
    while pos < end:
        restart = None
        for m in _LARK_TOKEN.finditer(text, pos):
            if m.start() != pos:
                break
            pos = m.end()
            kind = m.lastgroup
            if kind == "comment":
                continue
            kind = cast(str, kind)  # every alternative of the pattern is a named group
            tokens.append((kind, m.group(kind)))
            if len(tokens) > MAX_GRAMMAR_TOKENS:
                raise ValueError(f"the grammar has more than {MAX_GRAMMAR_TOKENS} tokens (names, strings, "
                                 "operators; MAX_GRAMMAR_TOKENS): shorten it")
            if kind == "keyword" and m.group(kind) in _JSON_VALUED:
                start = cast(re.Match, _JSON_WHITESPACE.match(text, pos)).end()  # matches the empty string
                try:
                    value, restart = decoder.raw_decode(text, start)
                except (ValueError, RecursionError) as e:
                    raise ValueError(f"the JSON after {m.group(kind)} cannot be read: {e}") from None
                tokens.append(("json", ""))
                if m.group(kind) == "%json":
                    schemas.append(value)
                break
        if restart is not None:
            pos = restart
        elif pos < end:
            line = text.count("\n", 0, pos) + 1
            raise ValueError(f"the grammar cannot be read at line {line}: {text[pos:pos + 20]!r}")
    return tokens, schemas


def _split_lark(tokens: list[tuple[str, str]]) -> tuple[list[list[tuple[str, str]]], list[list[tuple[str, str]]]]:
    """A grammar's tokens as items (a definition or a statement, as llguidance's parser splits
    them: a line break ends one unless ``|`` follows it), and the ``%lark { }`` grammars
    nested in them (each then a leaf of its item)."""
    items: list[list[tuple[str, str]]] = []
    nested: list[list[tuple[str, str]]] = []
    item: list[tuple[str, str]] = []
    i, n = 0, len(tokens)
    while i < n:
        kind, value = tokens[i]
        if kind == "keyword" and value == "%lark" and i + 1 < n and tokens[i + 1] == ("punct", "{"):
            depth, j = 1, i + 2
            while j < n:
                if tokens[j] == ("punct", "{"):
                    depth += 1
                elif tokens[j] == ("punct", "}"):
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            nested.append(tokens[i + 2 : j])
            item.append(("lark", ""))
            i = j + 1
            continue
        if kind == "newline":
            if not (i + 1 < n and tokens[i + 1] == ("punct", "|")):
                if item:
                    items.append(item)
                item = []
            i += 1
            continue
        item.append((kind, value))
        i += 1
    if item:
        items.append(item)
    return items, nested


def _rule_name(name: str) -> str:
    return name.removeprefix("!").removeprefix("?")


def _grammar_depth(tokens: list[tuple[str, str]]) -> tuple[int, list[list[tuple[str, str]]]]:
    """One grammar's depth (its items' tokens), and the grammars nested in it."""
    items, nested = _split_lark(tokens)
    names: dict[str, int] = {}
    weight: list[int] = []
    uses: list[list[str]] = []
    for k, item in enumerate(items):
        head = 0
        if item[0] == ("keyword", "%override") and len(item) > 1:
            head = 1
        if item[head][0] == "name":
            key = _rule_name(item[head][1])
        else:
            key = f"%{k}"  # %ignore (compiled first) and the statements
        depth = deepest = 0
        used = []
        for kind, value in item[head + 1 :] if item[head][0] == "name" else item:
            if kind == "name":
                used.append(_rule_name(value))
            elif kind == "punct" and value in "([{":
                depth += 1
                deepest = max(deepest, depth)
            elif kind == "punct" and value in ")]}":
                depth -= 1
        if key in names:  # a name defined twice (%override): one node with both bodies
            v = names[key]
            weight[v] = max(weight[v], 1 + deepest)
            uses[v] += used
        else:
            names[key] = len(weight)
            weight.append(1 + deepest)
            uses.append(used)
    edges = [[names[u] for u in used if u in names] for used in uses]
    return _longest_path(len(weight), edges, weight, weight, range(len(weight))), nested


def lark_depth(text: str) -> tuple[int, list[Any]]:
    """How deep llguidance's compiler may recurse into the Lark grammar ``text``: the heaviest
    chain of definitions that name one another (see the module doc), of the grammar and of
    each ``%lark { }`` grammar nested in it; and the schemas of its ``%json`` values (to be
    measured with :func:`schema_depth`).  ValueError where llguidance could not read it either."""
    tokens, schemas = _lark_tokens(text)
    deepest = 0
    todo = [(tokens, 0)]
    while todo:
        grammar, level = todo.pop()
        if level >= _MAX_LARK_NESTING:
            raise ValueError(f"%lark grammars are nested more than {_MAX_LARK_NESTING} deep")
        depth, nested = _grammar_depth(grammar)
        deepest = max(deepest, depth)
        todo.extend((g, level + 1) for g in nested)
    return deepest, schemas


# -- the checks --------------------------------------------------------------------------------


def check_schema_limits(schema: Any, param: str, where: str = "the schema") -> None:
    """Refuse, with a ``ValueError`` prefixed with ``param``, a JSON schema that llguidance's
    compiler could recurse into deeper than :data:`MAX_SCHEMA_DEPTH` allows (or too large to
    measure: :data:`MAX_SCHEMA_NODES`).  A schema that is not JSON passes (llguidance, or the
    caller, says what is wrong with it)."""
    try:
        schema = json.loads(json.dumps(schema))  # plain JSON, a tree
    except RecursionError:
        raise ValueError(f"{param}: {where} nests too deeply") from None
    except (TypeError, ValueError):
        return
    try:
        depth = schema_depth(schema)
    except ValueError as e:
        raise ValueError(f"{param}: {e}") from None
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"{param}: {where} nests {depth} levels deep once its $refs are followed (objects and arrays "
            f"within one another, a cycle of $refs counted in full), more than the {MAX_SCHEMA_DEPTH} allowed "
            "(MAX_SCHEMA_DEPTH): flatten it, or shorten the chains of definitions that $ref one another")


def check_grammar_limits(source: str, param: str) -> None:
    """Refuse, with a ``ValueError`` prefixed with ``param``, a grammar that llguidance's
    compiler could recurse into deeper than :data:`MAX_GRAMMAR_DEPTH` (Lark) or
    :data:`MAX_SCHEMA_DEPTH` (a JSON schema) allow.

    ``source``: what llguidance compiles, a Lark grammar or (first character ``{``) its JSON
    form, a list of Lark grammars and JSON schemas (``{"grammars": [...]}``).  Call it before
    anything of ``source`` reaches llguidance's compiler."""
    stripped = source.lstrip()
    if stripped.startswith("{"):
        try:
            top = json.loads(stripped)
        except RecursionError:
            raise ValueError(f"{param}: the grammar's JSON nests too deeply") from None
        except ValueError as e:
            raise ValueError(f"{param}: the grammar is not JSON: {e}") from None
        grammars = top.get("grammars") if isinstance(top, dict) else None
        if not isinstance(grammars, list):
            raise ValueError(f"{param}: a grammar in JSON form must be an object with a list of 'grammars'")
        lark = [g.get("lark_grammar") for g in grammars if isinstance(g, dict)]
        schemas = [g["json_schema"] for g in grammars if isinstance(g, dict) and g.get("json_schema") is not None]
    else:
        lark, schemas = [source], []
    for text in lark:
        if not isinstance(text, str):
            continue
        try:
            depth, nested_schemas = lark_depth(text)
        except RecursionError:
            raise ValueError(f"{param}: a %json value in the grammar nests too deeply") from None
        except ValueError as e:
            raise ValueError(f"{param}: {e}") from None
        if depth > MAX_GRAMMAR_DEPTH:
            raise ValueError(
                f"{param}: the grammar nests {depth} levels deep (rules and terminals that use one another, each "
                f"with the groups within it; a cycle counted in full), more than the {MAX_GRAMMAR_DEPTH} allowed "
                "(MAX_GRAMMAR_DEPTH): shorten the chains of rules that each use the next")
        for schema in nested_schemas:
            check_schema_limits(schema, param, "a %json schema of the grammar")
    for schema in schemas:
        check_schema_limits(schema, param)


# The keywords llguidance implements (json/schema.rs: IMPLEMENTED), and those it reads as
# annotations or to find references (META_AND_ANNOTATIONS), plus "deprecated", an annotation
# of JSON Schema 2019-09 that llguidance ignores as it should.
SCHEMA_KEYWORDS = frozenset({
    "anyOf", "oneOf", "allOf", "$ref", "const", "enum", "type",
    "items", "additionalItems", "prefixItems", "minItems", "maxItems",
    "properties", "additionalProperties", "patternProperties", "required", "minProperties", "maxProperties",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
SCHEMA_ANNOTATIONS = frozenset({
    "$anchor", "$defs", "definitions", "$schema", "$id", "id", "$comment", "title", "description", "default",
    "readOnly", "writeOnly", "examples", "contentMediaType", "contentEncoding", "deprecated",
})
# Where subschemas are: keyword -> how ("one": a schema, "map": name -> schema, "list": schemas).
_SUBSCHEMAS = {
    "properties": "map", "patternProperties": "map", "$defs": "map", "definitions": "map",
    "additionalProperties": "one", "additionalItems": "one", "items": "one_or_list",
    "prefixItems": "list", "anyOf": "list", "oneOf": "list", "allOf": "list",
}


def check_schema_keywords(schema: Mapping[str, Any], param: str) -> None:
    """Refuse, with a ``ValueError`` naming the subschema, a keyword that llguidance would not
    enforce (see the module doc), and an ``x-guidance`` that is not an object or is not at
    the top of the schema.  ``param``: the schema's field (``response_format.json_schema.schema``,
    ``tools[0].function.parameters``)."""
    options = schema.get("x-guidance")
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(f"{param}.x-guidance must be an object of llguidance's JSON options (such as "
                         f"{{'whitespace_flexible': false}}), not {type(options).__name__}")
    if options is not None and options.get("lenient") is True:
        return  # llguidance's own mode, asked for: unsupported keywords ignored
    seen: set[int] = set()
    todo: list[tuple[Any, str]] = [(schema, param)]
    while todo:
        node, where = todo.pop()
        if not isinstance(node, Mapping) or id(node) in seen:
            continue  # true/false, or not a schema (llguidance says so); or met already
        seen.add(id(node))
        unknown = [k for k in node if k not in SCHEMA_KEYWORDS and k not in SCHEMA_ANNOTATIONS
                   and not (k == "x-guidance" and node is schema)]
        if unknown:
            listed = ", ".join(repr(k)[:80] for k in unknown[:5])
            if unknown == ["x-guidance"]:
                raise ValueError(f"{where}: 'x-guidance' is read only at the top of the schema")
            raise ValueError(
                f"{where}: {listed} {'is not a keyword' if len(unknown) == 1 else 'are not keywords'} that structured "
                "output supports, so the reply would not follow it (supported: "
                f"{', '.join(sorted(SCHEMA_KEYWORDS))}; and annotations such as title and description)")
        for keyword, how in _SUBSCHEMAS.items():
            value = node.get(keyword)
            if how == "map" and isinstance(value, Mapping):
                todo.extend((v, f"{where}.{keyword}.{k}") for k, v in value.items())
            elif how == "one" or (how == "one_or_list" and not isinstance(value, list)):
                todo.append((value, f"{where}.{keyword}"))
            elif isinstance(value, list):
                todo.extend((v, f"{where}.{keyword}[{i}]") for i, v in enumerate(value))
