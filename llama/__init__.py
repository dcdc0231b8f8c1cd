"""Model-parallel inference for Meta's Llama 2 and Llama 3.x checkpoints."""

from .args import ModelArgs
from .chat_format import ChatFormat, Dialog, Llama2ChatFormat, Llama3ChatFormat, Message
from .generation import ChatPrediction, CompletionPrediction, Llama
from .model import Transformer
from .tokenizer import SentencePieceTokenizer, TiktokenTokenizer, Tokenizer, load_tokenizer

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
    "Dialog",
    "Message",
    "CompletionPrediction",
    "ChatPrediction",
]
