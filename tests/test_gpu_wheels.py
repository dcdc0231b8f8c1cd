"""benchmarks/gpu_wheels.sh: its pins agree with requirements.txt (every package it names, at a
version its specifier accepts) and requirements-test.txt's llama-models, and a wrong call gets
its usage line.  (Downloading needs the network; the script checks what comes down itself.)"""

from __future__ import annotations

import re
import subprocess

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import helpers

SCRIPT = helpers.REPO / "benchmarks" / "gpu_wheels.sh"


def _pins() -> dict[str, str]:
    text = SCRIPT.read_text()
    block = text[text.index("\nPINS=(") + 7:]
    block = block[: block.index("\n)")]
    pins = re.findall(r"^\s*([A-Za-z0-9._-]+)==(\S+)", block, re.M)
    assert pins and len(pins) == len({canonicalize_name(n) for n, _ in pins}), "one pin per package"
    return {canonicalize_name(name): version for name, version in pins}


def _requirements(name: str) -> list[Requirement]:
    reqs = []
    for line in (helpers.REPO / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            reqs.append(Requirement(line))
    return reqs


def test_every_requirement_but_torch_is_pinned_at_a_version_it_accepts():
    pins = _pins()
    for req in _requirements("requirements.txt"):
        name = canonicalize_name(req.name)
        if name == "torch":
            assert "torch" not in pins  # the GPU machine's own torch
            continue
        assert name in pins, f"{req} is not among benchmarks/gpu_wheels.sh's PINS"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} in gpu_wheels.sh, {req} in requirements.txt"
    llama_models = next(r for r in _requirements("requirements-test.txt") if r.name == "llama-models")
    assert llama_models.specifier.contains(pins["llama-models"])


def test_without_one_directory_it_prints_its_usage_and_exits_2():
    for args in ([], ["a", "b"], ["--help"]):
        proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and proc.stderr.startswith("usage: bash benchmarks/gpu_wheels.sh DIR")
        assert not proc.stdout
