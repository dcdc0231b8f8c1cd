"""Model-parallel inference for Meta's Llama 2 and Llama 3.x checkpoints."""

from .args import ModelArgs
from .chat_format import ChatFormat, CodeLlama70bInstructChatFormat, Dialog, Llama2ChatFormat, Llama3ChatFormat, Message
from .generation import ChatPrediction, CompletionPrediction, Llama
from .model import Transformer
from .tokenizer import SentencePieceTokenizer, TiktokenTokenizer, Tokenizer, load_tokenizer
from .tool_calls import ToolCall
from .tool_prompts import apply_tools

__all__ = [
    "Llama",
    "ModelArgs",
    "Transformer",
    "Tokenizer",
    "SentencePieceTokenizer",
    "TiktokenTokenizer",
    "load_tokenizer",
    "ChatFormat",
    "Llama2ChatFormat",
    "Llama3ChatFormat",
    "CodeLlama70bInstructChatFormat",
    "ToolCall",
    "apply_tools",
    "Dialog",
    "Message",
    "CompletionPrediction",
    "ChatPrediction",
]
