"""Model-parallel inference for Meta's Llama 2, Llama 3.x and Llama 4 checkpoints.

The names below are imported on first use (PEP 562), so ``import llama`` and the
command lines' ``--help`` do not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llama.runtime.lazy import lazy_exports

# module -> the public names it defines
_EXPORTS = {
    "generation": ("Llama", "CompletionPrediction", "ChatPrediction"),
    "args": ("ModelArgs",),
    "model": ("Transformer",),
    "tokenizer": ("Tokenizer", "SentencePieceTokenizer", "TiktokenTokenizer", "load_tokenizer", "Llama4Tokenizer"),
    "formats.chat": ("ChatFormat", "Llama2ChatFormat", "Llama3ChatFormat", "Llama4ChatFormat",
                     "CodeLlama70bInstructChatFormat", "Dialog", "Message"),
    "formats.tool_calls": ("ToolCall",),
    "formats.tool_prompts": ("apply_tools",),
    "formats.infilling": ("InfillingPrediction",),
}

__all__ = [name for names in _EXPORTS.values() for name in names]

if TYPE_CHECKING:  # for type checkers and IDEs: the eager imports
    from llama.args import ModelArgs
    from llama.formats.chat import (
        ChatFormat,
        CodeLlama70bInstructChatFormat,
        Dialog,
        Llama2ChatFormat,
        Llama3ChatFormat,
        Llama4ChatFormat,
        Message,
    )
    from llama.formats.infilling import InfillingPrediction
    from llama.formats.tool_calls import ToolCall
    from llama.formats.tool_prompts import apply_tools
    from llama.generation import ChatPrediction, CompletionPrediction, Llama
    from llama.model import Transformer
    from llama.tokenizer import Llama4Tokenizer, SentencePieceTokenizer, TiktokenTokenizer, Tokenizer, load_tokenizer

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
