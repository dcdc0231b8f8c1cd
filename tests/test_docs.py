"""The README's names are real: every ``llama....`` it names in code resolves, every
``from llama... import`` line in its examples imports, and its Layout section lists exactly
the packages and top-level modules of ``llama/``."""

from __future__ import annotations

import importlib
import re

import pytest

import helpers

README = (helpers.REPO / "README.md").read_text()


def _dotted_names() -> list[str]:
    names = set(re.findall(r"`(llama(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", README))
    return sorted(n for n in names if not n.startswith("llama.cpp"))


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("dotted", _dotted_names())
def test_named_objects_exist(dotted):
    _resolve(dotted)


@pytest.mark.parametrize("line", sorted(set(re.findall(r"^from llama[.\w]* import [\w, ]+$", README, re.M))))
def test_example_imports_work(line):
    exec(line, {})


def test_layout_lists_the_package():
    block = README[README.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[: block.index("```")]
    listed = set(re.findall(r"^(llama/[\w.]+/?)", block, re.M))
    root = helpers.REPO / "llama"
    actual = {f"llama/{p.name}/" for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    actual |= {f"llama/{p.name}" for p in root.glob("*.py") if p.name != "__init__.py"}
    assert listed == actual
