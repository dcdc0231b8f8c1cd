"""Side-by-side speed benchmark: this library against Hugging Face transformers.

Both run the same random weights (the HF model shares our tensors; only q/k are
stored permuted for HF's RoPE layout), the same dtype and the same thread count, in
one process, interleaved repetition by repetition.  Prints one table.

    python benchmarks/bench.py decode --config 150m --dtype float32 --threads 1 --batch 1
    python benchmarks/bench.py decode --config 1b --dtype bfloat16 --threads 2 --batch 1 --quantize int8
    python benchmarks/bench.py ragged_prefill --config 150m   # one-pass vs token-by-token prefill

Columns:
  prefill tok/s  prompt tokens / time of generating 1 token after the prompt
  decode tok/s   batch * 63 / (time for 64 new tokens - time for 1), median [min-max]
  ms/token       decode time per step
  % roofline     (weight bytes read per step / measured memory bandwidth) / step time
  % matmul       (the step's weight matmuls run alone) / step time
  model MiB      weights + buffers held (for this library including its preallocated KV cache)
  peak MiB       largest resident-memory rise during a generate call (transient
                 memory: activations, a growing KV cache)
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import fire
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama import Llama, ModelArgs  # noqa: E402
from llama import distributed  # noqa: E402
from llama.convert import hf_name, meta_to_hf_rope_rows, params_to_hf_config  # noqa: E402
from llama.model import Transformer  # noqa: E402
from llama.tokenizer import TiktokenTokenizer  # noqa: E402

logger = logging.getLogger("bench")

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


def _llama3_tokenizer() -> TiktokenTokenizer:
    import llama_models

    return TiktokenTokenizer(Path(llama_models.__file__).parent / "llama3" / "tokenizer.model")


def build_ours(config: str, dtype: torch.dtype, max_seq_len: int, max_batch_size: int, **build_options) -> Llama:
    """A Llama with random weights (no checkpoint on disk)."""
    args = ModelArgs(**CONFIGS[config], vocab_size=LLAMA3_VOCAB, max_seq_len=max_seq_len, max_batch_size=max_batch_size)
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
    model.load_state_dict(state, assign=True)
    model.setup_caches()
    llama = Llama(model, _llama3_tokenizer(), **build_options)
    llama.tokenizer.stop_tokens = frozenset()  # always decode the full length
    return llama


def build_hf(llama: Llama, dtype: torch.dtype, max_seq_len: int):
    """transformers' LlamaForCausalLM with the same weight values (q/k rows permuted for HF's RoPE)."""
    import transformers

    args = llama.model.params
    config = transformers.LlamaConfig(**{
        k: v for k, v in params_to_hf_config(args, dtype, max_position_embeddings=max_seq_len).items()
        if k not in ("architectures", "model_type", "torch_dtype", "rope_scaling", "rope_theta")
    })
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    state = {}
    for name, t in llama.model.state_dict().items():
        if ".attention.wq." in name:
            t = meta_to_hf_rope_rows(t, args.n_heads)
        elif ".attention.wk." in name:
            t = meta_to_hf_rope_rows(t, args.n_kv_heads)
        # HF gets its own weights in the usual row-major layout (ours may be stored
        # column-major for faster CPU decoding).
        state[hf_name(name)] = t.contiguous() if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)
    hf.load_state_dict(state, assign=True, strict=False)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config)  # its buffers were on meta
    return hf.eval()


class PeakRSS:
    """Samples this process's resident memory in a thread; ``rise`` is the peak above the start."""

    def __enter__(self):
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        self.rise = self.peak - self.start


def measure_bandwidth(threads: int, mib: int = 1024, reps: int = 5) -> float:
    """Bytes/s reading a buffer far larger than the caches (a sum over it)."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(reps))
    return x.numel() * 4 / best


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_weight_bytes(model: Transformer) -> int:
    """Bytes of weights one decode step reads: everything but the embedding table (one row)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "tok_embeddings" not in n)


def held_bytes(model: torch.nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def matmul_only_time(model: Transformer, batch: int, reps: int = 5) -> float:
    """Seconds for one step's weight matmuls alone (every linear layer, batch rows, one token)."""
    weights = [m.weight for m in model.modules() if hasattr(m, "weight") and m.weight.dim() == 2
               and m is not model.tok_embeddings]
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights}

    def step():
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    step()
    return statistics.median(_timed(step) for _ in range(reps))


def token_by_token_prefill(llama: Llama, prompts: list[list[int]]) -> None:
    """The reference generation loop's way through a ragged batch: one forward over the
    shortest prompt's length, then one position per forward for every row until the
    longest prompt is consumed (generated tokens would replace only the finished rows)."""
    model = llama.model
    tokens = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    start = min(map(len, prompts))
    model.forward(tokens[:, :start], 0)
    for pos in range(start, tokens.shape[1]):
        model.forward(tokens[:, pos : pos + 1], pos)


def ragged_prefill(config: str = "150m", dtype: str = "float32", threads: int = 1, short: int = 8, long: int = 500,
                   reps: int = 3) -> None:
    """Time a batch of a ``short``- and a ``long``-token prompt through the prompt phase:
    this library's one-pass prefill (generate with max_gen_len=1) against the reference
    loop's token-by-token path, interleaved."""
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(threads)
    llama = build_ours(config, distributed.resolve_dtype(dtype, torch.device("cpu")), long + 8, 2)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128000, (n,), generator=g).tolist() for n in (short, long)]
    one_pass, stepwise = [], []
    llama.generate(prompts, max_gen_len=1, temperature=0)
    for _ in range(reps):
        one_pass.append(_timed(lambda: llama.generate(prompts, max_gen_len=1, temperature=0)))
        stepwise.append(_timed(lambda: token_by_token_prefill(llama, prompts)))
    print(f"\nragged prefill, config {config}, {dtype}, {threads} thread(s): prompts of {short} and {long} tokens, {reps} reps")
    print(f"| path | seconds |\n|---|---|\n| one pass (this library) | {fmt_range(one_pass, digits=2)} |")
    print(f"| token by token (reference loop) | {fmt_range(stepwise, digits=2)} |")
    print(f"\none-pass prefill speed-up: {statistics.median(stepwise) / statistics.median(one_pass):.1f}x")


def fmt_range(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    v = sorted(x * scale for x in values)
    return f"{statistics.median(v):.{digits}f} [{v[0]:.{digits}f}-{v[-1]:.{digits}f}]"


def main(
    config: str = "150m",
    dtype: str = "float32",
    threads: int = 1,
    batch: int = 1,
    prompt_len: int = 128,
    new_tokens: int = 64,
    reps: int = 5,
    peer: bool = True,
    quantize: Optional[str] = None,
    compile: Optional[bool] = None,
):
    """Print the comparison table.

    Args:
        config: "150m", "1b" (Llama 3.2 1B shape) or "tiny".
        dtype: float32, bfloat16 or float16.
        threads: torch threads for both implementations.
        batch: rows decoded together.
        prompt_len: tokens per prompt.
        new_tokens: tokens generated in the long run (the short run generates 1).
        reps: interleaved repetitions.
        peer: also run Hugging Face transformers.
        quantize: also run this library with weight-only quantization ("int8").
        compile: compile this library's decode step (default: the library's default).
    """
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(threads)
    torch_dtype = distributed.resolve_dtype(dtype, torch.device("cpu"))
    max_seq_len = prompt_len + new_tokens + 8
    options = {} if compile is None else {"compile": compile}
    ours = build_ours(config, torch_dtype, max_seq_len, batch, **options)
    runners: dict[str, Callable[[list[list[int]], int], object]] = {
        "llama": lambda prompts, n: ours.generate(prompts, max_gen_len=n, temperature=0),
    }
    models = {"llama": ours.model}
    if quantize:
        quant = build_ours(config, torch_dtype, max_seq_len, batch, quantize=quantize, **options)
        runners[f"llama {quantize}"] = lambda prompts, n: quant.generate(prompts, max_gen_len=n, temperature=0)
        models[f"llama {quantize}"] = quant.model
    if peer:
        hf = build_hf(ours, torch_dtype, max_seq_len)

        def run_hf(prompts, n):
            with torch.inference_mode():
                return hf.generate(torch.tensor(prompts), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)

        runners["transformers"] = run_hf
        models["transformers"] = hf
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 128000, (batch, prompt_len), generator=g).tolist()

    for run in runners.values():  # warm-up (and compilation)
        run(prompts, 2)
        run(prompts, new_tokens)
    times: dict[str, dict[str, list[float]]] = {name: {"long": [], "short": [], "peak": []} for name in runners}
    for _ in range(reps):
        for name, run in runners.items():
            gc.collect()
            with PeakRSS() as mem:
                times[name]["long"].append(_timed(lambda: run(prompts, new_tokens)))
            times[name]["peak"].append(mem.rise)
            times[name]["short"].append(_timed(lambda: run(prompts, 1)))

    bandwidth = measure_bandwidth(threads)
    weight_bytes = decode_weight_bytes(ours.model)
    step_floor = matmul_only_time(ours.model, batch)
    n_params = sum(p.numel() for p in ours.model.parameters())
    print(f"\nconfig {config} ({n_params / 1e6:.0f}M parameters), dtype {dtype}, threads {threads}, batch {batch}, "
          f"prompt {prompt_len}, {new_tokens} new tokens, {reps} interleaved reps; torch {torch.__version__}")
    print(f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s; decode reads {weight_bytes / 2**20:.0f} MiB of weights "
          f"per step (roofline {weight_bytes / bandwidth * 1e3:.1f} ms); step matmuls alone {step_floor * 1e3:.1f} ms\n")
    header = f"| {'implementation':<16} | {'prefill tok/s':>22} | {'decode tok/s':>22} | {'ms/token':>8} | {'% roofline':>10} | {'% matmul':>8} | {'model MiB':>9} | {'peak MiB':>8} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for name, t in times.items():
        step = [(lo - sh) / (new_tokens - 1) for lo, sh in zip(t["long"], t["short"])]
        decode = [batch / s for s in step]
        prefill = [batch * prompt_len / s for s in t["short"]]
        med_step = statistics.median(step)
        model_bytes = decode_weight_bytes(models[name]) if name != "transformers" else weight_bytes
        print(f"| {name:<16} | {fmt_range(prefill, digits=0):>22} | {fmt_range(decode):>22} | {med_step * 1e3:8.1f} | "
              f"{100 * model_bytes / bandwidth / med_step:10.0f} | {100 * step_floor / med_step:8.0f} | "
              f"{held_bytes(models[name]) / 2**20:9.0f} | {statistics.median(t['peak']) / 2**20:8.0f} |")
    if "transformers" in times:
        ratio = statistics.median(times["transformers"]["long"]) - statistics.median(times["transformers"]["short"])
        ratio /= statistics.median(times["llama"]["long"]) - statistics.median(times["llama"]["short"])
        print(f"\ndecode speed-up over transformers: {ratio:.2f}x")


if __name__ == "__main__":
    fire.Fire({"decode": main, "ragged_prefill": ragged_prefill})
