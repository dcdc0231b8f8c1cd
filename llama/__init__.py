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
    "ModelArgs": "args",
    "Transformer": "model",
    "Tokenizer": "tokenizer",
    "SentencePieceTokenizer": "tokenizer",
    "TiktokenTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "ChatFormat": "chat_format",
    "Llama2ChatFormat": "chat_format",
    "Llama3ChatFormat": "chat_format",
    "Llama4ChatFormat": "chat_format",
    "CodeLlama70bInstructChatFormat": "chat_format",
    "Llama4Tokenizer": "tokenizer",
    "ToolCall": "tool_calls",
    "apply_tools": "tool_prompts",
    "InfillingPrediction": "infilling",
    "Dialog": "chat_format",
    "Message": "chat_format",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs: the eager imports
    from .args import ModelArgs
    from .chat_format import (
        ChatFormat, CodeLlama70bInstructChatFormat, Dialog, Llama2ChatFormat, Llama3ChatFormat, Llama4ChatFormat, Message,
    )
    from .generation import ChatPrediction, CompletionPrediction, Llama
    from .infilling import InfillingPrediction
    from .model import Transformer
    from .tokenizer import Llama4Tokenizer, SentencePieceTokenizer, TiktokenTokenizer, Tokenizer, load_tokenizer
    from .tool_calls import ToolCall
    from .tool_prompts import apply_tools


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llama' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
