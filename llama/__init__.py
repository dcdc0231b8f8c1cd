"""Model-parallel inference for Meta's Llama 2, Llama 3.x and Llama 4 checkpoints.

The names below are imported on first use (PEP 562), so ``import llama`` and the
command lines' ``--help`` do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "Llama": "generation",
    "CompletionPrediction": "generation",
    "ChatPrediction": "generation",
    "ModelArgs": "checkpoint.params",
    "Transformer": "model",
    "Tokenizer": "tokenizer",
    "SentencePieceTokenizer": "tokenizer",
    "TiktokenTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "ChatFormat": "formats.chat",
    "Llama2ChatFormat": "formats.chat",
    "Llama3ChatFormat": "formats.chat",
    "Llama4ChatFormat": "formats.chat",
    "CodeLlama70bInstructChatFormat": "formats.chat",
    "Llama4Tokenizer": "tokenizer",
    "ToolCall": "formats.tool_calls",
    "apply_tools": "formats.tool_prompts",
    "InfillingPrediction": "formats.infilling",
    "Dialog": "formats.chat",
    "Message": "formats.chat",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs: the eager imports
    from llama.checkpoint.params import ModelArgs
    from llama.formats.chat import (
        ChatFormat, CodeLlama70bInstructChatFormat, Dialog, Llama2ChatFormat, Llama3ChatFormat, Llama4ChatFormat, Message,
    )
    from llama.generation import ChatPrediction, CompletionPrediction, Llama
    from llama.formats.infilling import InfillingPrediction
    from llama.model import Transformer
    from llama.tokenizer import Llama4Tokenizer, SentencePieceTokenizer, TiktokenTokenizer, Tokenizer, load_tokenizer
    from llama.formats.tool_calls import ToolCall
    from llama.formats.tool_prompts import apply_tools


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llama' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
