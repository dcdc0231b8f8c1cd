"""Who may change what in the engine, read from the code's syntax (no model, no engine).

As in vLLM v1, the scheduler's update is the one writer of a running request's progress:
the runner returns data, the KV-cache manager keeps the block tables itself, the output
processor tells callers through their handles' public methods.  So, inside ``llama/engine``:

* no attribute of a :class:`~llama.engine.requests.RunningRequest` is assigned (``r.x = ``,
  ``r.x += ``, ``r.x[i] = ``, ``del r.x``) or mutated in place (``r.x.append(...)`` and the
  like) outside ``requests.py`` and ``scheduler.py``;
* no module reads or calls another object's ``_private`` members (``handle._finish``);
* no module but ``scheduler.py`` changes the scheduler's queues (``scheduler.queue.clear()``):
  it asks the scheduler (``abort_all``, ``admit``, ...).

The attributes of a running request are the ones its ``__init__`` sets, found in
``requests.py``.  An attribute write counts unless its receiver is ``self`` or a local name the
same function gives another type (a parameter annotated with another class, or a name bound
to another class's constructor): ``out.errors[i] = e`` on the runner's own output is no
request's state.  Each check prints what it finds, so a failure names the lines.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Optional

ENGINE = Path(__file__).resolve().parent.parent / "llama" / "engine"
REQUEST_STATE_WRITERS = {"requests.py", "scheduler.py"}  # the request itself, and the scheduler's update
SCHEDULER_QUEUES = {"queue", "local", "running", "preempted"}
MUTATING_METHODS = {"append", "extend", "insert", "pop", "popleft", "remove", "clear", "update", "setdefault",
                    "add", "discard", "appendleft", "extendleft", "sort", "reverse"}


def running_request_fields(engine: Path = ENGINE) -> set[str]:
    """The attributes ``RunningRequest.__init__`` sets (``self.x = ...``)."""
    tree = ast.parse((engine / "requests.py").read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "RunningRequest")
    init = next(node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    fields = set()
    for node in ast.walk(init):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and _is_self(target.value):
                fields.add(target.attr)
    assert {"n_fed", "pending", "generated"} <= fields, fields  # the reading itself works
    return fields


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _targets(node: ast.AST) -> list[ast.expr]:
    """The expressions ``node`` assigns or deletes, tuples unpacked."""
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        found = [node.target]
    else:
        return []
    out: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            out.append(target)
    return out


def _written_attribute(target: ast.expr) -> Optional[ast.Attribute]:
    """The attribute an assignment target changes: ``a.x`` for ``a.x``, ``a.x[i]``, ``a.x[i][j]``."""
    while isinstance(target, ast.Subscript):
        target = target.value
    return target if isinstance(target, ast.Attribute) else None


def _functions(tree: ast.Module) -> Iterator[ast.AST]:
    """Every function of ``tree``, and the module itself (for code outside functions)."""
    yield tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield node


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``scope`` outside the functions nested in it."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _names_of_other_types(scope: ast.AST) -> set[str]:
    """Local names ``scope`` gives a type other than RunningRequest: parameters annotated with
    another class, names bound to another class's constructor (``out = RunnerOutput()``)."""
    other = set()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = scope.args.posonlyargs + scope.args.args + scope.args.kwonlyargs
        for arg in args:
            if arg.annotation is not None and "RunningRequest" not in ast.unparse(arg.annotation):
                other.add(arg.arg)
    for node in _own_nodes(scope):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                and node.value.func.id[:1].isupper() and node.value.func.id != "RunningRequest"):
            other.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return other


def request_state_writes(engine: Path = ENGINE) -> list[str]:
    """``file:line: code`` of each write of a RunningRequest attribute outside the request and
    the scheduler."""
    fields = running_request_fields(engine)
    found = []
    for path in sorted(engine.glob("*.py")):
        if path.name in REQUEST_STATE_WRITERS:
            continue
        tree = ast.parse(path.read_text())
        for scope in _functions(tree):
            other = _names_of_other_types(scope)

            def counts(attribute: Optional[ast.Attribute]) -> bool:
                if attribute is None or attribute.attr not in fields or _is_self(attribute.value):
                    return False
                return not (isinstance(attribute.value, ast.Name) and attribute.value.id in other)

            for node in _own_nodes(scope):
                for target in _targets(node):
                    if counts(_written_attribute(target)):
                        found.append(f"{path.name}:{node.lineno}: {ast.unparse(target)}")
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in MUTATING_METHODS and counts(_written_attribute(node.func.value))):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def _imported_modules(tree: ast.Module) -> set[str]:
    """Names bound to modules from outside this package (``torch``): their private members
    are their own business, not this rule's."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names
                         if not alias.name.startswith("llama"))
    return names


def private_reaches(engine: Path = ENGINE) -> list[str]:
    """``file:line: code`` of each use of another object's ``_private`` member (not ``self``'s,
    not a third-party module's)."""
    found = []
    for path in sorted(engine.glob("*.py")):
        tree = ast.parse(path.read_text())
        modules = _imported_modules(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if _is_self(node.value) or (isinstance(root, ast.Name) and root.id in modules):
                continue
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def scheduler_queue_changes(engine: Path = ENGINE) -> list[str]:
    """``file:line: code`` of each change to the scheduler's queues made outside the scheduler."""
    found = []
    for path in sorted(engine.glob("*.py")):
        if path.name == "scheduler.py":
            continue
        tree = ast.parse(path.read_text())

        def of_scheduler(node: Optional[ast.expr]) -> bool:
            return (isinstance(node, ast.Attribute) and node.attr in SCHEDULER_QUEUES
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "scheduler")

        for node in ast.walk(tree):
            for target in _targets(node):
                if of_scheduler(_written_attribute(target)):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(target)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in MUTATING_METHODS and of_scheduler(_written_attribute(node.func.value))):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_only_the_request_and_the_scheduler_write_request_state():
    writes = request_state_writes()
    assert not writes, "RunningRequest state written outside requests.py/scheduler.py:\n" + "\n".join(writes)


def test_no_engine_module_reaches_into_another_objects_private_members():
    reaches = private_reaches()
    assert not reaches, "private members of another object used:\n" + "\n".join(reaches)


def test_only_the_scheduler_changes_its_queues():
    changes = scheduler_queue_changes()
    assert not changes, "the scheduler's queues changed outside scheduler.py:\n" + "\n".join(changes)


def test_the_checks_see_the_writes_they_look_for(tmp_path):
    """Each check finds a planted violation of its rule (and the exceptions stay exceptions)."""
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "requests.py").write_text(
        "class RunningRequest:\n"
        "    def __init__(self):\n"
        "        self.n_fed = 0\n"
        "        self.pending = None\n"
        "        self.generated = []\n"
        "        self.errors = {}\n"
    )
    (engine / "scheduler.py").write_text(
        "def update(request):\n"
        "    request.n_fed += 1\n"  # the scheduler may
        "    self.queue.clear()\n"
    )
    (engine / "runner.py").write_text(
        "import torch\n"
        "from llama.engine.scheduler import Scheduler\n"
        "def run(plan, out: 'RunnerOutput', engine):\n"
        "    for chunk in plan:\n"
        "        chunk.request.n_fed = chunk.end\n"  # 1
        "        chunk.request.generated.append(1)\n"  # 2
        "    request, other = plan[0], RunnerOutput()\n"
        "    request.pending, x = None, 1\n"  # 3
        "    del request.pending\n"  # 4
        "    out.errors[0] = None\n"  # the runner's own output: fine
        "    result = RunnerOutput()\n"
        "    result.errors[1] = None\n"  # fine too
        "    self.errors = {}\n"  # its own state: fine
        "    engine.handle._finish(None)\n"  # a private reach
        "    torch._dynamo.reset()\n"  # a third-party module's: not this rule's
        "    engine.scheduler.preempted.append(request)\n"  # a queue changed from outside
        "    engine.scheduler.queue = []\n"  # and another
    )
    writes = request_state_writes(engine)
    assert [w.split(": ", 1)[1] for w in writes] == [
        "chunk.request.n_fed", "chunk.request.generated.append(1)", "request.pending", "request.pending"], writes
    assert private_reaches(engine) == ["runner.py:14: engine.handle._finish"]
    assert scheduler_queue_changes(engine) == ["runner.py:16: engine.scheduler.preempted.append(request)",
                                               "runner.py:17: engine.scheduler.queue"]
