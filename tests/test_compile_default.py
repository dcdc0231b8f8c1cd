"""When decoding steps are compiled by default (``compile`` left unset): the rule of
:func:`llama.layers.policy.compile_by_default`, and that ``Llama`` follows it."""

from __future__ import annotations

import pytest
import torch

from helpers import build
from llama.layers.policy import COMPILE_PAYS_ON_CPU, compile_by_default

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("dtype, quantize, expected", [
    (torch.float32, None, False),  # slower compiled on AVX2 at 1 thread
    (torch.float16, None, False),  # not measured
    (torch.bfloat16, None, True),
    (torch.float32, "int8", True),
    (torch.bfloat16, "w8a8", True),
    (torch.float32, "int4", True),
])
def test_on_the_cpu_it_compiles_what_compiling_paid_for(dtype, quantize, expected):
    assert compile_by_default(CPU, dtype, quantize, environ={}, compiler="/usr/bin/g++") is expected
    # no C++ compiler: Inductor could not build the step
    assert compile_by_default(CPU, dtype, quantize, environ={}, compiler=None) is False


def test_a_gpu_compiles_and_the_environment_overrides():
    assert compile_by_default(CUDA, torch.float32, environ={}) is True
    assert compile_by_default(CUDA, torch.bfloat16, environ={"LLAMA_COMPILE": "0"}) is False
    assert compile_by_default(CPU, torch.float32, environ={"LLAMA_COMPILE": "1"}, compiler=None) is True
    with pytest.raises(ValueError, match="LLAMA_COMPILE='yes'"):
        compile_by_default(CPU, torch.float32, environ={"LLAMA_COMPILE": "yes"})


def test_the_precisions_are_the_ones_measured():
    """BENCHMARKS.md's compiled columns: bfloat16 and int8 on two or three CPU kinds, w8a8 and
    int4 on one; never float32 (slower on Zen 3)."""
    assert set(COMPILE_PAYS_ON_CPU) == {"bfloat16", "int8", "w8a8", "int4"}


def test_llama_follows_the_default(llama3_checkpoint, monkeypatch):
    """Unset, ``compile`` follows the rule: an int8 model compiles where a C++ compiler is
    found, a float32 one does not; LLAMA_COMPILE (the test suite sets 0) overrides it.
    (Compiling itself is replaced by a record of the call: tests that compile are elsewhere.)"""
    from llama.engine.runner import ModelRunner
    from llama.runtime import host

    compiled = []
    monkeypatch.setattr(ModelRunner, "compile", lambda self: compiled.append(self))
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: None)
    monkeypatch.delenv("LLAMA_COMPILE")
    has_compiler = host.cpp_compiler() is not None
    build(llama3_checkpoint, quantize="int8")
    assert len(compiled) == int(has_compiler)
    build(llama3_checkpoint)
    assert len(compiled) == int(has_compiler)  # float32: not compiled
    monkeypatch.setenv("LLAMA_COMPILE", "0")
    build(llama3_checkpoint, quantize="int8")
    assert len(compiled) == int(has_compiler)
    monkeypatch.setenv("LLAMA_COMPILE", "1")
    build(llama3_checkpoint)
    assert len(compiled) == int(has_compiler) + 1
