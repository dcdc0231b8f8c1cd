"""What the benchmark scripts share: the model shapes they time (:data:`CONFIGS`, with Llama 3's
128k vocabulary), the seeded random weights every engine is given, Meta's real Llama 3
tokenizer, the thread setting, and how bytes read per step and memory bandwidth are counted.
Imported by bench.py and peers.py (which import nothing else of each other's but bench.py's
use of peers)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llama import ModelArgs  # noqa: E402
from llama.layers.packed import packed_bytes  # noqa: E402
from llama.model import Transformer  # noqa: E402
from llama.runtime import distributed, host  # noqa: E402
from llama.tokenizer import TiktokenTokenizer  # noqa: E402

LLAMA3_VOCAB = 128256
CONFIGS = {
    # ~155M parameters; the 128k-vocabulary output matrix is 2/3 of what decode reads.
    "150m": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=2, multiple_of=256, norm_eps=1e-5, rope_theta=500000.0),
    # Llama 3.2 1B's shape (untied output: 1.5B parameters).
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
               norm_eps=1e-5, rope_theta=500000.0, use_scaled_rope=True, rope_scaling_factor=32.0),
    # For quick checks of the script itself.
    "tiny": dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=64, norm_eps=1e-5, rope_theta=500000.0),
}


def set_threads(threads: int) -> None:
    """Run torch on ``threads`` threads in this process.  The first model built in a
    process calls :func:`llama.runtime.host.configure_cpu_threads`, which would replace a
    count set before it (by every CPU); running it first makes it a no-op."""
    host.configure_cpu_threads()
    torch.set_num_threads(threads)


def llama3_tokenizer() -> TiktokenTokenizer:
    import llama_models

    return TiktokenTokenizer(Path(llama_models.__file__).parent / "llama3" / "tokenizer.model")


def random_weights(args: ModelArgs, dtype: torch.dtype) -> tuple[Transformer, dict[str, torch.Tensor]]:
    """(the model on the meta device, a state dict of seeded random weights for it): unit-variance
    embeddings, norm gains near 1, linear weights scaled by 1/sqrt(fan-in) (unit-scale activations
    and logits)."""
    distributed.init_model_parallel(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    state = {}
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight"):
            t = 1 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            t = torch.randn(p.shape, generator=g) * (1.0 if "tok_embeddings" in name else p.shape[-1] ** -0.5)
        state[name] = t.to(dtype)
    return model, state


def measure_bandwidth(threads: int, mib: int = 1024, reps: int = 5) -> float:
    """Bytes/s reading a buffer far larger than the caches (a sum over it)."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = min(timed(lambda: x.sum()) for _ in range(reps))
    return x.numel() * 4 / best


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rate_past_first_token(timed_run: Callable[[int], float], new_tokens: int, rows: int = 1, tries: int = 3) -> float:
    """Decode tokens a second: ``rows * new_tokens`` over ``timed_run(new_tokens + 1) -
    timed_run(1)`` (``timed_run(n)``: seconds to generate ``n`` tokens a row), so that the
    first token's cost (the prompt, the step that samples it) is taken off; the one-token run
    is timed twice and its shorter time kept, the run least disturbed.  On a small model the
    difference can be within the runs' noise (a tiny model whose draft agrees decodes 17
    tokens in four steps): a difference that is not positive is measured again, up to
    ``tries`` times, and then raises rather than give a negative or infinite rate."""
    for _ in range(tries):
        long = timed_run(new_tokens + 1)
        short = min(timed_run(1), timed_run(1))
        if long > short:
            return rows * new_tokens / (long - short)
    raise RuntimeError(f"{new_tokens} more tokens took no measurable time beyond the first one's in {tries} tries "
                       f"(last: {long:.4f} s against {short:.4f} s): ask for more new tokens")


def timed_rounds(calls: dict[str, Callable[[], object]], rounds: int, seconds: float) -> dict[str, list[float]]:
    """Seconds per call of each of ``calls``, taken in interleaved rounds (A, B, A, B, ...):
    per round, the median of the calls filling ``seconds`` (at least 3).  Each is called once
    first (a compiled one compiles there)."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples = []
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline or len(samples) < 3:
                start = time.perf_counter()
                call()
                samples.append(time.perf_counter() - start)
            times[name].append(statistics.median(samples))
    return times


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: everything but the embedding table (one row).
    Works for this library's model (float or int8 weights) and for transformers'."""
    tensors = [t for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if t.dim() >= 1 and "cache" not in n and "freqs" not in n and "rotary" not in n
               and "tok_embeddings" not in n and "embed_tokens" not in n]
    return sum(t.numel() * t.element_size() for t in tensors) + packed_bytes(model) + int4_kernel_bytes(model)


def int4_kernel_bytes(model: torch.nn.Module) -> int:
    """Bytes of the int4 matrices held in our CPU kernel's layout (not buffers: see
    llama.layers.prepare.use_cpu_int4_layout_), the embedding table's excepted as above."""
    from llama.layers.moe import Int4Experts
    from llama.layers.quantized import Int4Weight

    total = 0
    for module in model.modules():
        rows = getattr(module, "int4_kernel_rows", None)
        if isinstance(module, Int4Weight) and rows is not None:
            total += rows.numel()
        elif isinstance(module, Int4Experts) and rows is not None:
            total += sum(t.numel() for t in rows.values())
    return total
