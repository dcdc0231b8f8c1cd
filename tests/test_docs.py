"""The documentation's names are real and its links lead somewhere: every ``llama....`` the
README or a page of ``docs/`` names in code resolves, every ``from llama... import`` line in their
examples imports, the Layout section (docs/internals.md) lists exactly the packages and top-level
modules of ``llama/``, every relative link points to an existing file (and heading), and the
README stays a short front page: its contents list names its sections, it links every page of
``docs/``, and CI runs the commands its "Start here" block gives."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

import helpers

REPO = helpers.REPO
README_PATH = REPO / "README.md"
DOC_PATHS = sorted((REPO / "docs").glob("*.md"))
README = README_PATH.read_text()
# Everything the README said before it was split into docs/ is still checked, wherever it went.
DOCS = "\n".join(p.read_text() for p in [README_PATH, *DOC_PATHS])
# Markdown files whose links are checked: the README, docs/ and the pages they link beside them.
LINKED = [README_PATH, *DOC_PATHS, REPO / "BENCHMARKS.md", REPO / "demo" / "MODEL_CARD.md"]


def _dotted_names() -> list[str]:
    names = set(re.findall(r"`(llama(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", DOCS))
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


def test_docs_folder_holds_the_moved_sections():
    # The parametrised tests below read these pages: an empty glob would make them check nothing.
    names = {p.name for p in DOC_PATHS}
    assert {"serving.md", "structured-output.md", "tools.md", "checkpoints.md", "internals.md"} <= names


@pytest.mark.parametrize("dotted", _dotted_names())
def test_named_objects_exist(dotted):
    _resolve(dotted)


@pytest.mark.parametrize("line", sorted(set(re.findall(r"^from llama[.\w]* import [\w, ]+$", DOCS, re.M))))
def test_example_imports_work(line):
    exec(line, {})


def test_layout_lists_the_package():
    text = (REPO / "docs" / "internals.md").read_text()
    block = text[text.index("## Layout"):]
    block = block[block.index("```") + 3:]
    block = block[: block.index("```")]
    listed = set(re.findall(r"^(llama/[\w.]+/?)", block, re.M))
    root = REPO / "llama"
    actual = {f"llama/{p.name}/" for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    actual |= {f"llama/{p.name}" for p in root.glob("*.py") if p.name != "__init__.py"}
    assert listed == actual


# -- links ------------------------------------------------------------------------------------

_FENCE = re.compile(r"^ *```.*?^ *```", re.M | re.S)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and code spans (where brackets are not links)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces turned into hyphens (``"Structured output (`bench_grammar.py`)"`` ->
    ``"structured-output-bench_grammarpy"``)."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, repeated headings numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", _FENCE.sub("", path.read_text()), re.M):
        slug = github_anchor(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_github_anchor_matches_known_slugs():
    assert github_anchor("Structured output (`bench_grammar.py`)") == "structured-output-bench_grammarpy"
    assert github_anchor("CPU kernel findings behind today's choices") == "cpu-kernel-findings-behind-todays-choices"
    assert github_anchor("On a GPU (NVIDIA H100)") == "on-a-gpu-nvidia-h100"
    assert github_anchor("Errors, disconnects, shutdown and tools") == "errors-disconnects-shutdown-and-tools"


def _relative_links() -> list[tuple[str, str]]:
    links = []
    for path in LINKED:
        for target in _LINK.findall(_prose(path.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            links.append((str(path.relative_to(REPO)), target))
    return links


def test_links_are_found():
    # The README's own links to docs/ must be among those checked, or the next test checks nothing.
    assert ("README.md", "docs/serving.md") in _relative_links()


@pytest.mark.parametrize(("source", "target"), _relative_links())
def test_relative_link_resolves(source, target):
    src = REPO / source
    file_part, _, anchor = target.partition("#")
    dest = (src.parent / file_part).resolve() if file_part else src
    assert dest.exists(), f"{source} links to {target}: {dest} does not exist"
    assert dest.is_relative_to(REPO), f"{source} links outside the repository: {target}"
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), f"{source} links to {target}: no heading of {dest.name} has that anchor"


# -- the README as a front page ---------------------------------------------------------------


def test_readme_is_short():
    # A newcomer reads it in ten minutes (~200 words a minute, tables and commands included).
    words = len(README.split())
    assert words < 1500, f"README.md has {words} words: move detail into docs/"


def test_readme_contents_lists_its_sections():
    sections = re.findall(r"^## +(.+)$", _FENCE.sub("", README), re.M)
    contents = README[README.index("## Contents"):]
    contents = contents[: contents.index("\n## ", 1)]
    listed = re.findall(r"^- \[[^\]]+\]\(#([^)]+)\)", contents, re.M)
    assert listed == [github_anchor(s) for s in sections if s != "Contents"]


def test_readme_links_every_docs_page():
    linked = {t.partition("#")[0] for s, t in _relative_links() if s == "README.md"}
    assert {f"docs/{p.name}" for p in DOC_PATHS} <= linked


def test_ci_runs_the_start_here_commands():
    """.ci/run installs and tests with the very commands of the README's "Start here" block."""
    block = README[README.index("## Start here"):]
    block = block[block.index("```bash") + 7:]
    block = block[: block.index("```")]
    start_here = set()
    for line in block.splitlines():
        for command in line.split("#")[0].split("&&"):
            if command.strip():
                start_here.add(tuple(shlex.split(command)))
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    ran = [tuple(shlex.split(c)) for line in ci if line.startswith(("pip ", "python "))
           for c in line.split("&&")]
    assert any(c[:3] == ("python", "-m", "pytest") for c in ran)
    for command in ran:
        assert command in start_here, f".ci/run runs {' '.join(command)!r}, not a command of the README's Start here"
