"""The values the library and its command lines share, written once and importing nothing
heavy: reading a command line does not import torch.
"""

from __future__ import annotations

# Names of the dtypes Llama.build takes, and the dtype each means.
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}
QUANTIZATION_MODES = ("int8", "int4", "w8a8")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 kernels take
DEFAULT_INT4_GROUP_SIZE = 128
PACKING_KINDS = ("onednn", "fbgemm")  # CPU kernels bfloat16/float16 weights can be packed for
MAX_TOP_LOGPROBS = 20  # most alternatives a request may ask log-probabilities of
# Stop strings are looked for after every token, inside the engine's step, where their cost
# delays every request in the batch: at most this many per request (OpenAI's API allows 4),
# each at most this long.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256

# Tokens per block of the engine's paged KV cache: small enough that a request wastes little of
# its last block and short shared prefixes are reused, large enough that block tables stay short.
DEFAULT_KV_BLOCK_SIZE = 16


def check_kv_cache_tokens(kv_cache_tokens, max_batch_size: int, max_seq_len: int) -> int:
    """The paged KV cache's size in tokens: ``kv_cache_tokens``, checked, or by default
    ``max_batch_size * max_seq_len`` (what a slot of ``max_seq_len`` per request took).  It
    must hold one request of ``max_seq_len`` tokens, so that no request ever waits for
    blocks it could never get."""
    if kv_cache_tokens is None:
        return max_batch_size * max_seq_len
    if isinstance(kv_cache_tokens, bool) or not isinstance(kv_cache_tokens, int):
        raise TypeError(f"kv_cache_tokens must be an int, got {type(kv_cache_tokens).__name__}")
    if kv_cache_tokens < max_seq_len:
        raise ValueError(f"kv_cache_tokens={kv_cache_tokens} cannot hold one request of max_seq_len={max_seq_len} "
                         "tokens: give at least max_seq_len (or lower max_seq_len)")
    return kv_cache_tokens
