"""Fixtures shared by the tool-calling tests: this library's Llama 3 chat format and
llama-models' own, both on Meta's real Llama 3 tokenizer.  Import them into a test
module (``from llama3_formats import fmt, meta``) to use them."""

from __future__ import annotations

import pytest

from llama.formats.chat import Llama3ChatFormat
from llama.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def fmt(llama3_tokenizer_path):
    return Llama3ChatFormat(load_tokenizer(llama3_tokenizer_path))


@pytest.fixture(scope="module")
def meta():
    """llama-models' own ChatFormat, with its tokenizer."""
    pytest.importorskip("llama_models")
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    return ChatFormat(Tokenizer.get_instance())
