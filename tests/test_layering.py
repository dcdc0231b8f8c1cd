"""Which parts of ``llama/`` may import which, read from the source's import statements
(``ast``: every ``import`` and ``from ... import``, at the top of a module, inside a function
or under ``TYPE_CHECKING``), not from what a run happens to import.

The rules so far (each a row of :data:`FORBIDDEN`), from the bottom up:

* the model (``llama/model.py``, ``llama/vision.py``, ``llama/vision_mllama.py``, ``llama/args.py``,
  ``llama/layers/``) imports nothing above its layers: not the engine, the checkpoint loader or
  converter, the chat formats, structured output, the server, the command lines or the facade
  (loading is not the model's job);
* the engine (``llama/engine/``) never imports the server, the command lines or the facade;
* ``llama/lora/adapter.py`` (a LoRA adapter's factors, which the model's LoRA layers use) imports
  nothing above the model either;
* the server (``llama/serve/``) never imports the Meta-shaped facade (``llama.generation``,
  nor ``llama.Llama`` and the other names ``llama`` exports from it): it builds its model with
  :func:`llama.engine.build.build_engine` and plans chat requests with
  :mod:`llama.formats.chat_request`, as the facade does.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

import llama
from helpers import REPO

# What sits above the model: the engine and everything built on it.
_ABOVE_THE_MODEL = {"llama.engine", "llama.checkpoint", "llama.convert", "llama.formats", "llama.structured",
                    "llama.serve", "llama.cli", "llama.generation"}
_MODEL_WHY = "the model imports nothing above its layers (the engine and the loaders build on it, not it on them)"

# package folder or module file (relative to the repository) -> modules no file in it may import
# (a module or anything inside it), and why
FORBIDDEN = {
    "llama/model.py": (_ABOVE_THE_MODEL, _MODEL_WHY),
    "llama/vision.py": (_ABOVE_THE_MODEL, _MODEL_WHY),
    "llama/vision_mllama.py": (_ABOVE_THE_MODEL, _MODEL_WHY),
    "llama/args.py": (_ABOVE_THE_MODEL, _MODEL_WHY),
    "llama/layers": (_ABOVE_THE_MODEL, _MODEL_WHY),
    "llama/engine": ({"llama.serve", "llama.cli", "llama.generation"},
                     "the engine runs requests for the server and the facade; it never imports them"),
    "llama/serve": ({"llama.generation"}, "the server serves a built engine, not the Python API's facade"),
    # The model's LoRA layers import the adapter's in-memory form; reading PEFT's files
    # (llama/lora/peft.py: the converter's names, the checkpoint's file readers) is imported
    # by read_adapter when it is called, never by importing the module.
    "llama/lora/adapter.py": (_ABOVE_THE_MODEL, "the model's LoRA layers import it: it imports nothing above them"),
}


def module_name(path: Path, root: Path) -> str:
    """``llama/serve/chat.py`` -> ``llama.serve.chat`` (``__init__.py``: the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> Iterator[tuple[str, int]]:
    """(module imported, line) for every import statement in ``source``, the source of
    ``module``: relative imports resolved, and ``from llama import Name`` read as the module
    ``llama`` takes ``Name`` from (its lazy exports: ``Llama`` is ``llama.generation``'s)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield target, node.lineno
            for alias in node.names:  # `from llama import generation`, `from llama import Llama`
                if target == "llama":
                    yield _llama_export(alias.name), node.lineno
                else:
                    yield f"{target}.{alias.name}", node.lineno


def _llama_export(name: str) -> str:
    """The module behind ``from llama import name``."""
    for module, names in llama._EXPORTS.items():
        if name in names:
            return f"llama.{module}"
    return f"llama.{name}"


def violations(root: Path, folder: str, forbidden: set[str]) -> list[str]:
    """``path:line imports module`` for each import statement under ``root/folder`` (a package
    folder or one module's file) of a module in ``forbidden`` (or inside one), once per statement."""
    found: dict[str, str] = {}
    where = root / folder
    for path in [where] if where.is_file() else sorted(where.rglob("*.py")):
        module = module_name(path, root)
        for target, line in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            if any(target == f or target.startswith(f + ".") for f in forbidden):
                found.setdefault(f"{path.relative_to(root)}:{line}", target)
    return [f"{where} imports {target}" for where, target in found.items()]


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_part_imports_what_its_layer_forbids(folder):
    forbidden, why = FORBIDDEN[folder]
    found = violations(REPO, folder, forbidden)
    assert not found, f"{folder} must not import {sorted(forbidden)} ({why}):\n" + "\n".join(found)


def test_every_rule_reads_existing_code():
    """A rule over a folder or file that is not there (renamed, moved) would pass for nothing."""
    for folder in FORBIDDEN:
        where = REPO / folder
        assert where.is_file() or any(where.rglob("*.py")), f"{folder}: no Python code there"


def test_the_reading_finds_every_form_of_import(tmp_path):
    """The reader of imports, on a package written here: each way of importing the facade is
    found (so that the rules above can fail), and nothing else is."""
    pkg = tmp_path / "llama" / "serve"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .. import generation\n")
    (pkg / "a.py").write_text(
        "import json\n"
        "from typing import TYPE_CHECKING\n"
        "import llama.generation\n"
        "from llama.generation import Llama\n"
        "from llama import Llama, Tokenizer\n"
        "if TYPE_CHECKING:\n"
        "    from llama.generation import ChatPrediction\n"
        "def main():\n"
        "    from llama.generation import Llama\n"
        "from ..generation import Llama\n"
        "from llama.engine.build import build_engine\n"
        "from llama.generations import other\n"
    )
    found = violations(tmp_path, "llama/serve", {"llama.generation"})
    lines = sorted(int(f.split(":")[1].split()[0]) for f in found if f.startswith("llama/serve/a.py"))
    assert lines == [3, 4, 5, 7, 9, 10], found
    assert [f for f in found if f.startswith("llama/serve/__init__.py")] == [
        "llama/serve/__init__.py:1 imports llama.generation"]


def test_a_module_file_is_read_as_well_as_a_folder(tmp_path):
    """A rule over one module (``llama/model.py``) reads that file: an engine import in it is
    found, as one in a module under a ruled folder is; the module beside it is not read."""
    (tmp_path / "llama" / "layers").mkdir(parents=True)
    (tmp_path / "llama" / "model.py").write_text("import torch\nfrom llama.engine.core import Engine\n")
    (tmp_path / "llama" / "other.py").write_text("from llama.engine.core import Engine\n")
    (tmp_path / "llama" / "layers" / "moe.py").write_text("from ..engine import requests\n")
    assert violations(tmp_path, "llama/model.py", _ABOVE_THE_MODEL) == [
        "llama/model.py:2 imports llama.engine.core"]
    assert violations(tmp_path, "llama/layers", _ABOVE_THE_MODEL) == [
        "llama/layers/moe.py:1 imports llama.engine"]
