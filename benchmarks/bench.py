"""Side-by-side speed benchmark: this library against Hugging Face transformers, and
(``peers``) against llama.cpp too.

    python benchmarks/bench.py peers --config 150m --threads 1,2 --dtypes float32,bfloat16,int8,int4 --rounds 3
    python benchmarks/bench.py peers_batch --config 150m --threads 1,2 --dtypes int8,int4 --batch 8   # 8 rows vs 1
    python benchmarks/bench.py decode --config 150m --dtype float32 --threads 1 --batch 1
    python benchmarks/bench.py decode --config 1b --dtype bfloat16 --threads 2 --batch 1 --quantize int8
    python benchmarks/bench.py ragged_prefill --config 150m   # one-pass vs token-by-token prefill
    python benchmarks/bench.py batch_scaling --config 150m --batch 8   # batch-8 vs batch-1 decode
    python benchmarks/bench.py batch_scaling --dtype bfloat16 --quantize int4 --compile True   # int8/int4 too
    python benchmarks/bench.py int8_agreement --ckpt_dir demo   # int8 vs full-precision greedy text
    python benchmarks/bench.py sampling   # the next token: llama.engine.sampling vs Meta's reference arithmetic
    python benchmarks/bench.py step_anatomy --config 150m --dtype bfloat16 --threads 1   # a decoding step's time
    python benchmarks/bench.py live_length --config 150m   # max_seq_len 32768 against 256, eager and compiled

``peers``: what a user of each engine gets, on the same weights.  One set of random weights is
written as a Meta checkpoint (with Meta's real Llama 3 tokenizer), converted to Hugging Face
(``python -m llama.convert meta_to_hf``) and from there to GGUF by llama.cpp's own converter:
F32, BF16 and Q8_0 for float32, bfloat16 and int8, and Q4_0 (llama.cpp's quantiser, every
matrix) for int4 (see benchmarks/peers.py).  The output rows of the special tokens are zero, so
greedy decoding never emits an end-of-text token and every engine generates exactly the tokens
asked for (checked on every call).  Each measurement starts a fresh process for one engine at one
precision and thread count (torch.set_num_threads + OMP_NUM_THREADS/MKL_NUM_THREADS for the
torch engines, n_threads = n_threads_batch for llama.cpp); rounds are interleaved, and the order
of the engines rotates from round to round.  In each process, after one warm-up completion of each
prompt length:
  this library   Llama.build(ckpt_dir, tokenizer_path, max_seq_len, max_batch_size=1, dtype=...,
                 quantize=...) and text_completion([prompt], temperature=0, max_gen_len=n)
  transformers   AutoModelForCausalLM.from_pretrained(hf_dir, dtype=...) and greedy generate
                 (float32 and bfloat16 only: it has no CPU int8/int4 kernels of its own)
  llama.cpp      llama_cpp.Llama(model_path, n_ctx, n_threads=T, n_threads_batch=T) and
                 create_completion(prompt, max_tokens=n, temperature=0)
decode tok/s = N / (time of N + 1 new tokens - time of 1 new token) after a prompt of the same
length (different prompts, so no engine reuses a cached prefix); prefill tok/s = prompt tokens of
a longer prompt / its time to first token.  Before any timing, the float32 greedy tokens of the
three are compared, and a disagreement of this library with llama.cpp stops the run.

The peer, llama.cpp, is not a dependency of this library.  Install it built from source with
native CPU flags, and unpack its source for llama.cpp's converter (``--converter``; by default it
is looked for under /tmp/*/*/vendor/llama.cpp/)::

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python gguf --no-binary llama-cpp-python
    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/lcp && tar xzf /tmp/lcp/*.tar.gz -C /tmp/lcp
    # converter: /tmp/lcp/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py

On a CPU with AMX, llama.cpp 0.3.36's AMX kernels crash on Q8_0 (a segfault in
ggml_backend_amx_mul_mat, llama.cpp issue #20824); build it with everything native but AMX::

    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'" pip install \\
        --force-reinstall --no-deps llama-cpp-python --no-binary llama-cpp-python

Without it, ``peers`` still runs this library and transformers (it says why llama.cpp is skipped).

``step_anatomy`` runs this library alone (see its docstring).  The other modes run this
library and transformers on the same random weights (the HF model shares our tensors; only q/k
are stored permuted for HF's RoPE layout), the same dtype and the same thread count, in one
process, interleaved repetition by repetition.  Each prints one table.

Columns (``decode``):
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

import contextlib
import gc
import importlib.metadata
import importlib.util
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

import peers  # noqa: E402  (benchmarks/peers.py)
from common import (  # noqa: E402  (benchmarks/common.py)
    CONFIGS,
    LLAMA3_VOCAB,
    decode_weight_bytes,
    llama3_tokenizer,
    measure_bandwidth,
    random_weights,
    rate_past_first_token,
    set_threads,
    timed,
)
from llama import Llama, ModelArgs  # noqa: E402
from llama.convert import hf_name, meta_to_hf_rope_rows, params_to_hf_config  # noqa: E402
from llama.engine.sampling import SamplingParams, sample_next_token  # noqa: E402
from llama.layers.packed import PackedWeight, packed_bytes, unpack_weights_, use_packed_weights_  # noqa: E402
from llama.layers.parallel import ParallelLinear, RowParallel  # noqa: E402
from llama.layers.policy import KernelPolicy  # noqa: E402
from llama.layers.quantize import quantize_int4_, quantize_int8_, use_int8_activations_  # noqa: E402
from llama.layers.quantized import FusedProjections  # noqa: E402
from llama.model import Transformer  # noqa: E402
from llama.runtime import devices  # noqa: E402
from llama.runtime.finite import scale_by_temperature  # noqa: E402

logger = logging.getLogger("bench")

# int4's group beside llama.cpp's Q4_0: 64 values, Q4_0's size (4.5 bits a weight: a bfloat16
# scale and offset per 64 against Q4_0's float16 scale per 32), closer to the weights than Q4_0
# (tests/test_quantization.py)
INT4_GROUP = 64


def build_ours(config: str, dtype: torch.dtype, max_seq_len: int, max_batch_size: int,
               quantize: Optional[str] = None, **options) -> Llama:
    """A Llama with random weights (no checkpoint on disk), set up as ``Llama.build`` would."""
    if quantize not in (None, "int8", "w8a8", "int4"):
        raise ValueError(f"the in-process modes build quantize=None, 'int8', 'w8a8' or 'int4', got {quantize!r}")
    args = ModelArgs(**CONFIGS[config], vocab_size=LLAMA3_VOCAB, max_seq_len=max_seq_len, max_batch_size=max_batch_size)
    model, state = random_weights(args, dtype)
    model.load_state_dict(state, assign=True)
    if quantize == "int4":
        quantize_int4_(model, INT4_GROUP)
    if quantize in ("int8", "w8a8"):
        quantize_int8_(model)
        if quantize == "w8a8":
            use_int8_activations_(model, KernelPolicy.decide(torch.device("cpu"), dtype, quantize=quantize))
    model.setup_rope()
    options.setdefault("compile", False)  # eager unless the mode asks (the CPU default compiles bfloat16)
    llama = Llama(model, llama3_tokenizer(), **options)
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


def row_major_twin(ours: Llama, hf, **options) -> Llama:
    """Another Llama on the same weight values, stored row-major (as the compiled CPU
    path wants them).  Shares the HF model's row-major tensors where the layouts agree
    (all but q/k), to keep three models of 1B parameters within this machine's RAM."""
    hf_state = hf.state_dict() if hf is not None else {}
    state = {}
    for name, t in ours.model.state_dict().items():
        shared = hf_state.get(hf_name(name))
        if shared is not None and ".attention.wq." not in name and ".attention.wk." not in name:
            state[name] = shared
        else:
            state[name] = t.contiguous() if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)
    with torch.device("meta"):
        model = Transformer(ours.model.params)
    model.load_state_dict(state, assign=True)
    model.setup_rope()
    twin = Llama(model, ours.tokenizer, **options)
    twin.tokenizer.stop_tokens = frozenset()
    return twin


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


def held_bytes(model: torch.nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors) + packed_bytes(model)


def matmul_only_time(llama: Llama, batch: int, reps: int = 5) -> float:
    """Seconds for one step's weight matmuls alone: every linear layer's local product,
    with the kernels (and weight layout, and int8 weights) the library decodes with;
    layers that read the same input as their module's one product, as the step runs them
    (its ``fused`` product)."""
    products, grouped = [], set()  # (product, input features)
    for m in llama.model.modules():
        group = getattr(m, "fused", None)
        if group is not None:
            siblings = [getattr(m, name) for name in m.packable_input_projections]
            grouped.update(siblings)
            products.append((group, siblings[0].in_features))
    for m in llama.model.modules():
        if isinstance(m, ParallelLinear) and m not in grouped:
            local_in = m.input_size_per_partition if isinstance(m, RowParallel) else m.in_features
            products.append((m.local_matmul, local_in))
    dtype = llama.model.dtype
    layers = [product for product, _ in products]
    inputs = [torch.randn(batch, 1, n, dtype=dtype) for _, n in products]

    def matmuls(inputs):
        return [product(x) for product, x in zip(layers, inputs)]

    if llama.compiled:  # the compiled step's matmuls are compiled code too
        matmuls = _compiled_matmuls.setdefault(id(llama), torch.compile(matmuls, dynamic=False))

    def step():
        with torch.inference_mode():
            matmuls(inputs)

    step()
    return statistics.median(timed(step) for _ in range(reps))


_compiled_matmuls: dict = {}


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
    set_threads(threads)
    llama = build_ours(config, devices.resolve_dtype(dtype, torch.device("cpu")), long + 8, 2)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128000, (n,), generator=g).tolist() for n in (short, long)]
    one_pass, stepwise = [], []
    llama.generate(prompts, max_gen_len=1, temperature=0)
    for _ in range(reps):
        one_pass.append(timed(lambda: llama.generate(prompts, max_gen_len=1, temperature=0)))
        stepwise.append(timed(lambda: token_by_token_prefill(llama, prompts)))
    print(f"\nragged prefill, config {config}, {dtype}, {threads} thread(s): prompts of {short} and {long} tokens, "
          f"{reps} reps")
    print(f"| path | seconds |\n|---|---|\n| one pass (this library) | {fmt_range(one_pass, digits=2)} |")
    print(f"| token by token (reference loop) | {fmt_range(stepwise, digits=2)} |")
    print(f"\none-pass prefill speed-up: {statistics.median(stepwise) / statistics.median(one_pass):.1f}x")


def batch_scaling(config: str = "150m", dtype: str = "float32", threads: int = 1, batch: int = 8,
                  prompt_len: int = 128, new_tokens: int = 64, reps: int = 5, quantize: Optional[str] = None,
                  compile: bool = False) -> None:
    """Decode tokens/s of one row against ``batch`` rows decoded together (same model,
    interleaved): batching reuses each weight read for every row.  ``quantize``: "int8",
    "w8a8" or "int4" (groups of :data:`INT4_GROUP`, as ``peers``), with ``dtype`` the activations'
    (bfloat16 as ``peers``); ``compile``: compiled decoding steps."""
    logging.basicConfig(level=logging.WARNING)
    set_threads(threads)
    llama = build_ours(config, devices.resolve_dtype(dtype, torch.device("cpu")), prompt_len + new_tokens + 8, batch,
                       quantize=quantize, compile=compile)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, 128000, (batch, prompt_len), generator=g).tolist()
    rates: dict[int, list[float]] = {1: [], batch: []}
    for rows in rates:
        llama.generate(prompts[:rows], max_gen_len=4, temperature=0)
    for _ in range(reps):
        for rows in rates:
            long = timed(lambda: llama.generate(prompts[:rows], max_gen_len=new_tokens, temperature=0))
            short = timed(lambda: llama.generate(prompts[:rows], max_gen_len=1, temperature=0))
            rates[rows].append(rows * (new_tokens - 1) / (long - short))
    print(f"\nbatch scaling, config {config}, {dtype}{', ' + quantize if quantize else ''}, "
          f"{'compiled' if compile else 'eager'}, {threads} thread(s), {reps} interleaved reps")
    print("| rows | decode tok/s |\n|---|---|")
    for rows, r in rates.items():
        print(f"| {rows} | {fmt_range(r)} |")
    speedup = statistics.median(rates[batch]) / statistics.median(rates[1])
    print(f"\nbatch-{batch} / batch-1 decode tokens/s: {speedup:.1f}x")


def live_length(config: str = "150m", dtype: str = "bfloat16", threads: int = 1, long: int = 32768,
                short: int = 256, prompt_len: int = 16, new_tokens: int = 64, reps: int = 5) -> None:
    """Decode tokens/s with the same short prompt in a model of ``max_seq_len=short`` and one of
    ``max_seq_len=long``, eager and compiled (four models, interleaved): a step's attention should
    cost what the live context costs, not what the cache could hold.  Also prints each compiled
    model's first-call (compile) time.  Target: long / short at least 0.85, compiled and eager."""
    logging.basicConfig(level=logging.WARNING)
    set_threads(threads)
    torch_dtype = devices.resolve_dtype(dtype, torch.device("cpu"))
    prompt = torch.randint(0, 128000, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    llamas: dict[tuple[str, int], Llama] = {}
    first_call: dict[tuple[str, int], float] = {}
    for mode in ("eager", "compiled"):
        for seq in (short, long):
            start = time.perf_counter()
            llama = build_ours(config, torch_dtype, seq, 1, compile=mode == "compiled")
            llama.generate([prompt], max_gen_len=new_tokens, temperature=0)  # warm-up (and compilation)
            first_call[mode, seq] = time.perf_counter() - start
            llamas[mode, seq] = llama
    rates: dict[tuple[str, int], list[float]] = {key: [] for key in llamas}
    for _ in range(reps):
        for key, llama in llamas.items():
            run_long = timed(lambda: llama.generate([prompt], max_gen_len=new_tokens, temperature=0))
            run_short = timed(lambda: llama.generate([prompt], max_gen_len=1, temperature=0))
            rates[key].append((new_tokens - 1) / (run_long - run_short))
    print(f"\nlive length, config {config}, {dtype}, {threads} thread(s), prompt {prompt_len}, {new_tokens} new "
          f"tokens, {reps} interleaved reps; decode tok/s median [min-max]")
    print(f"| step | max_seq_len {short} | max_seq_len {long} | {long} / {short} "
          f"| build + first call, s ({short} / {long}) |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("eager", "compiled"):
        a, b = rates[mode, short], rates[mode, long]
        ratio = statistics.median(b) / statistics.median(a)
        print(f"| {mode} | {fmt_range(a)} | {fmt_range(b)} | {ratio:.2f} | "
              f"{first_call[mode, short]:.1f} / {first_call[mode, long]:.1f} |")


AGREEMENT_PROMPTS = [
    "To be, or not to be,", "Friends, Romans, countrymen,", "Now is the winter of our discontent",
    "What light through yonder window", "The quality of mercy is not strained;", "All the world's a stage,",
    "If music be the food of love,", "Once more unto the breach, dear friends,", "Tomorrow, and tomorrow,",
    "Shall I compare thee to a summer's day?", "KING.\nWhat news", "HAMLET.\nMy lord,", "Enter the Duke",
    "O Romeo, Romeo,", "Good morrow, gentle", "I pray you, sir,", "The king is dead", "Come, my lord,",
    "FIRST CITIZEN.\nWhat say you", "Alas, poor", "Is this a dagger", "Double, double", "Love looks not",
    "The lady doth protest", "Cry havoc", "Beware the ides", "Lord, what fools", "We few, we happy few,",
    "Brevity is the soul", "Some are born great,", "A horse! a horse!", "Exit, pursued", "Et tu,",
    "There is nothing either good or bad,", "The course of true love", "My kingdom", "Out, damned spot!",
    "Parting is such sweet sorrow,", "How sharper than a serpent's tooth", "Let slip the dogs",
]


def int8_agreement(ckpt_dir: str = "demo", dtype: str = "float32", max_gen_len: int = 32, threads: int = 2) -> None:
    """How often int8 weights give the same greedy text as full precision, on a trained
    checkpoint (default: the bundled demo model), and how far their logits differ."""
    logging.basicConfig(level=logging.WARNING)
    set_threads(threads)
    ckpt = Path(ckpt_dir)
    kw = dict(max_seq_len=128, max_batch_size=len(AGREEMENT_PROMPTS), device="cpu", dtype=dtype)
    full = Llama.build(ckpt, ckpt / "tokenizer.model", **kw)
    tokens = [full.tokenizer.encode(p, bos=True, eos=False) for p in AGREEMENT_PROMPTS]
    shortest = min(map(len, tokens))
    batch = torch.tensor([t[:shortest] for t in tokens])
    reference, _ = full.generate(tokens, max_gen_len=max_gen_len, temperature=0)
    reference_logits = full.model.forward(batch, 0)
    variants = {"int8": dict(kw, quantize="int8")}
    if dtype == "float32":  # the rounding a plain bfloat16 run brings, for scale
        variants["bfloat16"] = dict(kw, dtype="bfloat16")
    print(f"\nagainst greedy {dtype} on {ckpt}, {len(tokens)} prompts, {max_gen_len} new tokens each:")
    print("| variant | identical continuations | median identical prefix | logits relative error |\n|---|---|---|---|")
    for name, options in variants.items():
        other = Llama.build(ckpt, ckpt / "tokenizer.model", **options)
        out, _ = other.generate(tokens, max_gen_len=max_gen_len, temperature=0)
        same = sum(x == y for x, y in zip(reference, out))
        prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                  for x, y in zip(reference, out)]
        err = (other.model.forward(batch, 0) - reference_logits).norm() / reference_logits.norm()
        print(f"| {name} | {same}/{len(out)} | {statistics.median(prefix)} tokens | {err.item():.4f} |")


def reference_next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Meta's reference arithmetic for the same choice: torch.argmax; top-k by masking;
    top-p by sorting the whole vocabulary; torch.multinomial."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    logits = scale_by_temperature(logits, params.temperature)
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p >= 1.0:
        return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    probs_sorted, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    probs_sorted = probs_sorted.masked_fill(mass_before > params.top_p, 0.0)
    choice = torch.multinomial(probs_sorted, num_samples=1, generator=generator)
    return torch.gather(order, -1, choice).squeeze(-1)


def sampling(threads: str = "1,2", vocabs: str = "32000,128256,202048", rows: str = "1,8", reps: int = 25,
             end_to_end: bool = True, rounds: int = 5, new_tokens: int = 48) -> None:
    """Cost of choosing the next token from (rows, vocab) float32 logits: llama.sampling
    against Meta's reference arithmetic (:func:`reference_next_token`) on the same logits,
    interleaved call by call; medians [ranges] in ms.

    Logits are Gaussian.  "peaked" (standard deviation 3) leaves a nucleus of a few tokens
    at temperature 0.6, top-p 0.9, as a trained model's next-token distribution mostly
    does; "flat" (0.2) one of most of the vocabulary, as a model with random weights gives:
    the worst case of the candidate search, which then sorts everything as the reference does.

    ``end_to_end``: then ``text_completion`` of the 150m config in bfloat16 (threads: the
    first of ``threads``) with the default sampling (temperature 0.6, top-p 0.9), the
    engine choosing tokens with llama.engine.sampling or with the reference arithmetic, alternated
    ``rounds`` times; decode tok/s.  Random weights give near-flat next-token
    distributions, so the output matrix is scaled by 20 to make them as peaked as a
    trained model's (the nucleus size is printed).
    """
    cases = [
        ("greedy", SamplingParams(temperature=0), 10.0),
        ("T 0.6, top-p 0.9, peaked", SamplingParams(), 3.0),
        ("T 0.6, top-p 0.9, flat", SamplingParams(), 0.2),
        ("T 0.6, top-p 1 (whole vocabulary)", SamplingParams(top_p=1.0), 3.0),
        ("T 0.6, top-k 50, top-p 0.9", SamplingParams(top_k=50), 3.0),
    ]
    print("| threads | vocab | rows | choice | nucleus (tokens) | reference ms | llama.engine.sampling ms | speed-up |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|")
    for t in as_list(threads):
        set_threads(int(t))
        for vocab in as_list(vocabs):
            for n_rows in as_list(rows):
                g = torch.Generator().manual_seed(0)
                for name, params, spread in cases:
                    logits = torch.randn(int(n_rows), int(vocab), generator=g) * spread
                    probs = torch.softmax(logits / 0.6, dim=-1)
                    if params.top_k is not None:  # the nucleus of the renormalised top k
                        probs = torch.softmax(torch.topk(logits / 0.6, params.top_k, dim=-1).values, dim=-1)
                    nucleus_size = "all" if params.top_p >= 1 and params.top_k is None else (
                        1 if params.greedy else int(reference_kept_count(probs, params.top_p).median()))
                    ours, ref = [], []
                    with torch.inference_mode():
                        for i in range(int(reps) + 2):
                            a = timed(lambda: reference_next_token(logits, params, g))
                            b = timed(lambda: sample_next_token(logits, params, g))
                            if i >= 2:  # warm-up
                                ref.append(a)
                                ours.append(b)
                    ratio = statistics.median(ref) / statistics.median(ours)
                    print(f"| {t} | {vocab} | {n_rows} | {name} | {nucleus_size} | {fmt_range(ref, 1e3, 2)} | "
                          f"{fmt_range(ours, 1e3, 2)} | {ratio:.1f}x |", flush=True)
    if end_to_end:
        sampling_end_to_end(int(as_list(threads)[0]), int(rounds), int(new_tokens))


def sampling_end_to_end(threads: int, rounds: int, new_tokens: int) -> None:
    """See :func:`sampling`."""
    import llama.engine.sampler as engine_module  # where the engine's sampler finds the two functions

    set_threads(threads)
    llama = build_ours("150m", torch.bfloat16, 512, 1)
    packed = isinstance(llama.model.output, PackedWeight)
    if packed:
        unpack_weights_(llama.model)
    with torch.no_grad():
        llama.model.output.weight.mul_(20)
    if packed:
        use_packed_weights_(llama.model, llama.policy)
    prompt = "Once upon a time, in a land far away, there"
    ids = llama.tokenizer.encode(prompt, bos=True, eos=False)
    with torch.inference_mode():
        probs = torch.softmax(llama.model.forward(torch.tensor([ids]), 0)[0, -1] / 0.6, dim=-1)
    nucleus_size = int(reference_kept_count(probs.unsqueeze(0), 0.9)[0])
    ours = (engine_module.sample_next_token, engine_module.greedy_tokens)
    reference = (lambda logits, params, generator=None, **_: reference_next_token(logits, params, generator),
                 lambda logits: torch.argmax(logits, dim=-1))
    results: dict[str, list[float]] = {"reference": [], "llama.engine.sampling": []}

    def timed_run(n: int) -> float:
        start = time.perf_counter()
        llama.text_completion([prompt], max_gen_len=n, temperature=0.6, top_p=0.9)
        return time.perf_counter() - start

    def decode_rate(n: int) -> float:
        return rate_past_first_token(timed_run, n)

    for r in range(rounds + 1):
        for name, (sample, greedy) in (("reference", reference),
                                       ("llama.engine.sampling", ours))[:: 1 if r % 2 else -1]:
            engine_module.sample_next_token, engine_module.greedy_tokens = sample, greedy
            rate = decode_rate(new_tokens)
            if r:  # round 0 warms up
                results[name].append(rate)
    engine_module.sample_next_token, engine_module.greedy_tokens = ours
    print(f"\ntext_completion, 150m bfloat16, {threads} thread(s), temperature 0.6, top-p 0.9 "
          f"(nucleus of the first step: {nucleus_size} tokens), {new_tokens} tokens, {rounds} rounds:\n")
    print("| engine's sampler | decode tok/s |\n|---|---:|")
    for name, rates in results.items():
        print(f"| {name} | {fmt_range(rates)} |")
    speedup = statistics.median(results['llama.engine.sampling']) / statistics.median(results['reference'])
    print(f"\nspeed-up: {speedup:.2f}x")


def reference_kept_count(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Tokens in each row's top-p nucleus (the reference's rule)."""
    probs_sorted = torch.sort(probs, dim=-1, descending=True).values
    return ((torch.cumsum(probs_sorted, dim=-1) - probs_sorted) <= p).sum(-1).float()


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
    compiled: bool = False,
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
        compiled: also run this library with ``compile=True`` (torch.compile'd decode step).
    """
    logging.basicConfig(level=logging.WARNING)
    set_threads(threads)
    torch_dtype = devices.resolve_dtype(dtype, torch.device("cpu"))
    max_seq_len = prompt_len + new_tokens + 8
    ours = build_ours(config, torch_dtype, max_seq_len, batch)
    runners: dict[str, Callable[[list[list[int]], int], object]] = {
        "llama": lambda prompts, n: ours.generate(prompts, max_gen_len=n, temperature=0),
    }
    llamas = {"llama": ours}
    hf = build_hf(ours, torch_dtype, max_seq_len) if peer else None
    if compiled:
        llamas["llama compiled"] = row_major_twin(ours, hf, compile=True)
    if quantize:
        llamas[f"llama {quantize}"] = build_ours(config, torch_dtype, max_seq_len, batch, quantize=quantize)
    for name, llama in llamas.items():
        runners[name] = lambda prompts, n, llama=llama: llama.generate(prompts, max_gen_len=n, temperature=0)
    models = {name: llama.model for name, llama in llamas.items()}
    if peer:

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
    matmul_times: dict[str, list[float]] = {name: [] for name in llamas}
    for _ in range(reps):  # interleaved: the machine's speed drifts, so compare within a repetition
        for name, run in runners.items():
            gc.collect()
            with PeakRSS() as mem:
                times[name]["long"].append(timed(lambda: run(prompts, new_tokens)))
            times[name]["peak"].append(mem.rise)
            times[name]["short"].append(timed(lambda: run(prompts, 1)))
            if name in llamas:
                matmul_times[name].append(matmul_only_time(llamas[name], batch, reps=3))

    bandwidth = measure_bandwidth(threads)
    weight_bytes = decode_weight_bytes(ours.model)
    floors = {name: statistics.median(t) for name, t in matmul_times.items()}
    n_params = sum(p.numel() for p in ours.model.parameters())
    print(f"\nconfig {config} ({n_params / 1e6:.0f}M parameters), dtype {dtype}, threads {threads}, batch {batch}, "
          f"prompt {prompt_len}, {new_tokens} new tokens, {reps} interleaved reps; torch {torch.__version__}")
    print(f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s; a decode step reads {weight_bytes / 2**20:.0f} MiB of "
          f"weights (roofline {weight_bytes / bandwidth * 1e3:.1f} ms); "
          + "; ".join(f"{n}: step matmuls alone {t * 1e3:.1f} ms" for n, t in floors.items()) + "\n")
    header = (f"| {'implementation':<16} | {'prefill tok/s':>22} | {'decode tok/s':>22} | {'ms/token':>8} | "
              f"{'% roofline':>10} | {'% matmul':>8} | {'model MiB':>9} | {'peak MiB':>8} |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for name, t in times.items():
        step = [(lo - sh) / (new_tokens - 1) for lo, sh in zip(t["long"], t["short"])]
        decode = [batch / s for s in step]
        prefill = [batch * prompt_len / s for s in t["short"]]
        med_step = statistics.median(step)
        matmul = f"{100 * floors[name] / med_step:8.0f}" if name in floors else f"{'-':>8}"
        print(f"| {name:<16} | {fmt_range(prefill, digits=0):>22} | {fmt_range(decode):>22} | {med_step * 1e3:8.1f} | "
              f"{100 * decode_weight_bytes(models[name]) / bandwidth / med_step:10.0f} | {matmul} | "
              f"{held_bytes(models[name]) / 2**20:9.0f} | {statistics.median(t['peak']) / 2**20:8.0f} |")
    def step_time(name: str) -> float:
        return statistics.median(times[name]["long"]) - statistics.median(times[name]["short"])

    print()
    for name in llamas:
        if "transformers" in times:
            print(f"decode speed-up of {name} over transformers: {step_time('transformers') / step_time(name):.2f}x")
        if name != "llama":
            print(f"decode speed-up of {name} over llama: {step_time('llama') / step_time(name):.2f}x")


# -- where a decoding step's time goes ------------------------------------------------------------


class Products:
    """Every weight product of a forward pass: each parallel layer's ``local_matmul`` and each
    fused group's ``product`` (together all of them, once each).
    Within :meth:`hooked`, ``mode`` "time" computes each and adds its seconds to ``seconds``;
    "record" also keeps (method, module, input, output) in call order; "replay" returns the
    recorded outputs in that order without computing anything."""

    def __init__(self) -> None:
        self.mode = "time"
        self.seconds = 0.0
        self.calls: list[tuple[Callable, object, torch.Tensor, torch.Tensor]] = []
        self.next = 0
        self.evict: Optional[torch.Tensor] = None  # in "replay": read (summed) at each product, in self.seconds

    @contextlib.contextmanager
    def hooked(self, model: torch.nn.Module):
        """Every product of ``model`` goes through this probe (each module's own method,
        wrapped on the module) until the block ends."""
        targets = [(m, "local_matmul") for m in model.modules() if isinstance(m, ParallelLinear)]
        targets += [(m, "product") for m in model.modules() if isinstance(m, FusedProjections)]

        def wrap(module, method):
            def product(x):
                if self.mode == "replay":
                    out = self.calls[self.next][3]
                    self.next += 1
                    if self.evict is not None:
                        start = time.perf_counter()
                        self.evict.sum()
                        self.seconds += time.perf_counter() - start
                    return out
                start = time.perf_counter()
                out = method(x)
                self.seconds += time.perf_counter() - start
                if self.mode == "record":
                    self.calls.append((method, module, x, out))
                return out

            return product

        for module, name in targets:
            setattr(module, name, wrap(module, getattr(module, name)))
        try:
            yield self
        finally:
            for module, name in targets:
                delattr(module, name)  # the class's method again


def step_anatomy(config: str = "150m", dtype: str = "bfloat16", threads: int = 1, quantize: Optional[str] = None,
                 context: int = 64, steps: int = 50, rounds: int = 3, evict_mib: str = "4,64") -> None:
    """Where one eager decoding step's time goes (batch 1, this library's model in process,
    as ``Llama.build`` sets it up): the whole step; its weight products, timed where they
    run inside it and replayed alone back to back (the same calls on the same inputs in the
    same order); and the rest, timed as the step minus its products, and alone: the step
    run with every product replaced by its recorded output, so that no weight streams
    through the caches between the other operations.  Medians over ``steps`` steps at
    positions ``context``.. (each attends to its cache, as in decoding), ``rounds`` rounds.

    ``evict_mib``: the rest alone again, with that many MiB of an unrelated buffer read at
    each product instead (its time left out), to show how much of the gap between the
    rest in the step and alone is the products pushing the rest's code and data out of the
    caches (one row per size; "" for none)."""
    logging.basicConfig(level=logging.WARNING)
    set_threads(threads)
    torch_dtype = devices.resolve_dtype(dtype, torch.device("cpu"))
    llama = build_ours(config, torch_dtype, context + steps + 1, 1, quantize=quantize)
    model, token = llama.model, torch.tensor([[5]])
    probe = Products()

    def run_steps() -> tuple[float, float]:
        """(median step seconds, median seconds of its products, or of the evicting reads)."""
        totals, products = [], []
        for pos in range(context, context + steps):
            probe.seconds, probe.next = 0.0, 0
            start = time.perf_counter()
            model.decode_logits(token, torch.tensor([[pos]]), pos + 1, model.forward_cache())
            totals.append(time.perf_counter() - start)
            products.append(probe.seconds)
        return statistics.median(totals), statistics.median(products)

    evictions = {int(mib): torch.ones(int(mib) * 2**20 // 4) for mib in as_list(evict_mib) if int(mib)}
    rows: dict[str, list[float]] = {k: [] for k in ("step", "products in the step", "products alone",
                                                    "rest in the step", "rest alone")}
    rows.update({f"rest alone, {mib} MiB read at each product": [] for mib in evictions})
    with torch.inference_mode(), probe.hooked(model):
        model.forward(torch.randint(0, 128000, (1, context)), 0)
        probe.mode = "record"
        model.decode_logits(token, torch.tensor([[context]]), context + 1, model.forward_cache())
        recorded = probe.calls
        for _ in range(rounds):
            probe.mode = "time"
            run_steps()  # warm-up
            step, products = run_steps()
            replayed = []
            for _ in range(steps):
                start = time.perf_counter()
                for method, _, x, _ in recorded:
                    method(x)
                replayed.append(time.perf_counter() - start)
            probe.mode = "replay"
            rest_alone, _ = run_steps()
            evicted = []
            for buffer in evictions.values():
                probe.evict = buffer
                run_steps()  # warm-up
                total, reads = run_steps()
                evicted.append(total - reads)
            probe.evict = None
            values = (step, products, statistics.median(replayed), step - products, rest_alone, *evicted)
            for key, value in zip(rows, values):
                rows[key].append(value)
    print(f"\none decoding step, config {config}, {dtype}{' ' + quantize if quantize else ''}, {threads} thread(s), "
          f"batch 1, context {context}; {len(recorded)} weight products per step; medians of {steps} steps, "
          f"{rounds} rounds; torch {torch.__version__}\n")
    print("| part | ms [range over rounds] | % of the step |\n|---|---:|---:|")
    step = statistics.median(rows["step"])
    for key, values in rows.items():
        print(f"| {key} | {fmt_range(values, scale=1e3, digits=2)} | {100 * statistics.median(values) / step:.0f} |")


# -- this library beside transformers and llama.cpp, each in its own process ----------------------


def _llama_cpp_converter(names: list[str], converter: Optional[str]) -> Optional[Path]:
    """llama.cpp's convert_hf_to_gguf.py where "llama.cpp" is among the engines ``names`` and can
    run; where it cannot (llama-cpp-python or the converter missing), says why on stderr and
    takes it out of ``names``.  None where llama.cpp does not run."""
    if "llama.cpp" not in names:
        return None
    conv = None
    if importlib.util.find_spec("llama_cpp") is None:
        missing = "llama-cpp-python is not installed"
    elif (conv := peers.find_converter(converter)) is None:
        missing = "llama.cpp's convert_hf_to_gguf.py was not found (pass --converter)"
    if conv is None:
        print(f"llama.cpp skipped: {missing}; see the docstring of benchmarks/bench.py for the install",
              file=sys.stderr)
        names.remove("llama.cpp")
    return conv


def compare_peers(
    config: str = "150m",
    threads=(1, 2),
    dtypes=peers.PRECISIONS,
    rounds: int = 3,
    new_tokens: int = 128,
    prompt_tokens: int = 16,
    prefill_tokens: int = 256,
    check_tokens: int = 16,
    int4_group_size: int = 64,  # INT4_GROUP (a literal: the command line shows the default)
    quant_dtype: str = "bfloat16",
    engines=peers.DEFAULT_ENGINES,
    converter: Optional[str] = None,
    workdir: str = "/tmp/bench_peers",
) -> None:
    """This library, transformers and llama.cpp on the same random weights, each engine in a fresh
    process per measurement, rounds interleaved; prints one table.

    Args:
        config: "150m", "1b" or "tiny".
        threads: thread counts, e.g. 1,2.
        dtypes: precisions among float32,bfloat16,int8,w8a8,int4 (llama.cpp: F32, BF16, Q8_0, Q8_0, Q4_0;
            transformers runs float32 and bfloat16 only).
        rounds: measurements of every engine x precision x threads (medians and ranges over them).
        new_tokens: N, decode tokens/s = N / (time of N + 1 new tokens - time of 1).
        prompt_tokens: tokens of the decode prompts (BOS included).
        prefill_tokens: tokens of the prefill prompt; prefill tokens/s = them / time to first token.
        check_tokens: greedy tokens compared across engines (float32 must agree before timing).
        int4_group_size: this library's int4 group (64: Q4_0's size, 4.5 bits a weight -- a
            bfloat16 scale and offset per 64 values against Q4_0's float16 scale per 32 -- and
            closer to the weights than Q4_0: tests/test_quantization.py).
        quant_dtype: this library's activations' dtype with int8/int4 weights.
        engines: among llama,llama-compiled,transformers,llama.cpp (llama-compiled: compile=True;
            its warm-up completion compiles the decoding step, 10-20 s).
        converter: llama.cpp's convert_hf_to_gguf.py (default: looked for under /tmp).
        workdir: where the checkpoint, HF and GGUF files are written once and reused (remove
            ``workdir/config`` after changing CONFIGS).
    """
    started = time.perf_counter()
    thread_counts = [int(t) for t in as_list(threads)]
    precisions = as_list(dtypes)
    names = as_list(engines)
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {sorted(CONFIGS)}, got {config!r}")
    for value, allowed, what in ((precisions, peers.PRECISIONS, "dtypes"), (names, peers.ENGINES, "engines")):
        if not value or not set(value) <= set(allowed):
            raise ValueError(f"{what} must be among {','.join(allowed)}, got {value}")
    if "llama" not in names:
        raise ValueError("engines must include llama (this library): the others are compared with it")
    names = [e for e in peers.ENGINES if e in names]  # this library first
    conv = _llama_cpp_converter(names, converter)
    if "transformers" in names and importlib.util.find_spec("transformers") is None:
        print("transformers skipped: not installed", file=sys.stderr)
        names.remove("transformers")

    work = Path(workdir) / config
    ckpt = peers.write_checkpoint(config, "float32", work / "meta", silent_specials=True)
    tokenizer = llama3_tokenizer()
    prompts = peers.make_prompts(tokenizer, prompt_tokens, prefill_tokens)
    hf = peers.make_hf(ckpt, work) if {"transformers", "llama.cpp"} & set(names) else None
    ggufs = ({p: peers.make_gguf(ckpt, work, p, conv) for p in ["float32"] + precisions}
             if "llama.cpp" in names else {})
    base = dict(ckpt=str(ckpt), hf=str(hf), max_seq_len=max(prompt_tokens + new_tokens + 1, prefill_tokens + 1),
                new_tokens=new_tokens, prompts=prompts, check_tokens=check_tokens, int4_group_size=int4_group_size,
                quant_dtype=quant_dtype)

    def spec(engine: str, precision: str, threads: int, mode: str) -> dict:
        return dict(base, engine=engine, precision=precision, threads=threads, mode=mode,
                    gguf=str(ggufs.get(precision, "")))

    # Before any timing: the same greedy tokens in float32.
    agree = {e: peers.run_worker(spec(e, "float32", thread_counts[0], "agree")) for e in names}
    print(f"\nfloat32 greedy agreement, first {check_tokens} tokens after a {prompt_tokens}-token prompt:")
    for e, r in agree.items():
        print(f"  {e:<12} prompt {_ids(r['agree_prompt'])}\n  {'':<12} tokens {_ids(r['agree_ids'])}")
    for e in names[1:]:
        same_prompt = agree[e]["agree_prompt"] == agree["llama"]["agree_prompt"]
        prefix = _same_prefix(agree[e]["agree_ids"], agree["llama"]["agree_ids"])
        print(f"  llama vs {e}: prompt tokens {'identical' if same_prompt else 'DIFFER'}, "
              f"{prefix}/{check_tokens} generated tokens identical")
        if e == "llama.cpp" and (not same_prompt or prefix < check_tokens):
            raise SystemExit("this library and llama.cpp disagree in float32 on the same weights: the comparison "
                             "would not be of the same model (see the tokens above)")

    results: dict[tuple[str, str, int], list[dict]] = {}
    bandwidth: dict[int, list[float]] = {t: [] for t in thread_counts}
    for r in range(rounds):
        for t in thread_counts:
            bandwidth[t].append(peers.run_worker(dict(mode="bandwidth", threads=t))["bandwidth"])
            for p in precisions:
                cell = [e for e in names if e != "transformers" or p in ("float32", "bfloat16")]
                for e in cell[r % len(cell):] + cell[: r % len(cell)]:  # who goes first rotates by round
                    res = peers.run_worker(spec(e, p, t, "time"))
                    counted = (res["long_prompt_tokens"], res["short_prompt_tokens"], res["prefill_prompt_tokens"])
                    if counted != (prompt_tokens, prompt_tokens, prefill_tokens):
                        raise RuntimeError(f"{e} counted prompts of {counted} tokens, not {prompt_tokens} and "
                                           f"{prefill_tokens}: its tokenizer differs, the work would not be the same")
                    results.setdefault((e, p, t), []).append(res)
                    print(f"round {r + 1}/{rounds}, {t} thread(s), {p}, {e}: decode "
                          f"{new_tokens / (res['long_s'] - res['short_s']):.1f} tok/s, prefill "
                          f"{res['prefill_prompt_tokens'] / res['prefill_s']:.0f} tok/s", file=sys.stderr, flush=True)

    n_params = sum(t.numel() for t in torch.load(ckpt / "consolidated.00.pth", mmap=True, weights_only=True).values())
    versions = ", ".join(f"{pkg} {_version(pkg)}" for pkg in ("torch", "transformers", "llama_cpp_python"))
    print(f"\nconfig {config} ({n_params / 1e6:.0f}M parameters), batch 1, greedy; decode: {prompt_tokens}-token "
          f"prompt, {new_tokens} new tokens; prefill: {prefill_tokens}-token prompt; {rounds} round(s), every "
          f"engine in a fresh process per measurement; {versions}")
    print("measured read bandwidth: " + "; ".join(
        f"{t} thread(s) {statistics.median(b) / 1e9:.1f} GB/s" for t, b in bandwidth.items()))
    print(f"this library: Llama.build(dtype=..., quantize=...) + text_completion; int8/int4 with {quant_dtype} "
          f"activations, w8a8 with int8 activations per token in one-row products, int4 in groups of "
          f"{int4_group_size}; llama.cpp: GGUF from meta_to_hf + convert_hf_to_gguf.py "
          f"(Q4_0: llama_model_quantize --pure)\n")
    print("\n".join(peer_table(results, {t: statistics.median(b) for t, b in bandwidth.items()}, new_tokens,
                               check_tokens, int4_group_size)))
    print(f"\n(whole run: {(time.perf_counter() - started) / 60:.1f} min)")


def compare_peers_batch(
    config: str = "150m",
    threads=(1, 2),
    dtypes=("int8", "int4"),
    batch: int = 8,
    rounds: int = 3,
    reps: int = 3,
    new_tokens: int = 32,
    prompt_tokens: int = 16,
    int4_group_size: int = 64,  # INT4_GROUP, as ``peers``
    quant_dtype: str = "bfloat16",
    engines=("llama-compiled", "llama.cpp"),
    converter: Optional[str] = None,
    workdir: str = "/tmp/bench_peers",
) -> None:
    """Decode tokens/s of ``batch`` rows decoded together against one row, for this library and
    llama.cpp on the same weights (``peers``' files): how much a batch gains in each engine.  Each
    engine x precision x thread count runs in a fresh process per round (the engines' order
    rotating), which times 1 and ``batch`` rows ``reps`` times each, interleaved:
      this library   Llama.build(max_batch_size=batch) and generate(rows, temperature=0), the
                     steps past each row's first token (``rate_past_first_token``)
      llama.cpp      a context of ``batch`` sequences (n_seq_max) and one llama_decode a step of a
                     token a sequence, as llama-server decodes its slots; greedy from each row's logits

    Args:
        config: "150m", "1b" or "tiny".
        threads: thread counts, e.g. 1,2.
        dtypes: among float32,bfloat16,int8,w8a8,int4 (llama.cpp: F32, BF16, Q8_0, Q8_0, Q4_0).
        batch: rows decoded together.
        rounds: processes per engine x precision x threads (medians and ranges over them).
        reps: timings of 1 and of ``batch`` rows in each process (their medians are the round's).
        new_tokens: decoding steps timed per timing.
        prompt_tokens: tokens of each row's prompt (BOS included; a different prompt a row).
        engines: among llama,llama-compiled,llama.cpp.
    """
    started = time.perf_counter()
    thread_counts = [int(t) for t in as_list(threads)]
    precisions, names = as_list(dtypes), as_list(engines)
    if config not in CONFIGS:
        raise ValueError(f"config must be one of {sorted(CONFIGS)}, got {config!r}")
    if not precisions or not set(precisions) <= set(peers.PRECISIONS):
        raise ValueError(f"dtypes must be among {','.join(peers.PRECISIONS)}, got {precisions}")
    if not names or not set(names) <= {"llama", "llama-compiled", "llama.cpp"}:
        raise ValueError(f"engines must be among llama,llama-compiled,llama.cpp, got {names}")
    if batch < 2:
        raise ValueError(f"batch must be at least 2 (it is compared with one row), got {batch}")
    conv = _llama_cpp_converter(names, converter)
    work = Path(workdir) / config
    ckpt = peers.write_checkpoint(config, "float32", work / "meta", silent_specials=True)
    tokenizer = llama3_tokenizer()
    prompts = {"rows": [peers.make_prompt(tokenizer, 300 + r, prompt_tokens) for r in range(batch)]}
    ggufs = {p: peers.make_gguf(ckpt, work, p, conv) for p in precisions} if "llama.cpp" in names else {}
    base = dict(ckpt=str(ckpt), max_seq_len=prompt_tokens + new_tokens + 8, new_tokens=new_tokens, prompts=prompts,
                batch=batch, reps=reps, int4_group_size=int4_group_size, quant_dtype=quant_dtype, mode="batch")
    results: dict[tuple[str, str, int], list[dict]] = {}
    for r in range(rounds):
        for t in thread_counts:
            for p in precisions:
                for e in names[r % len(names):] + names[: r % len(names)]:  # who goes first rotates by round
                    res = peers.run_worker(dict(base, engine=e, precision=p, threads=t, gguf=str(ggufs.get(p, ""))))
                    results.setdefault((e, p, t), []).append(res)
                    one, many = (statistics.median(res["step_s"][str(k)]) for k in (1, batch))
                    print(f"round {r + 1}/{rounds}, {t} thread(s), {p}, {e}: 1 row {1 / one:.1f} tok/s, {batch} rows "
                          f"{batch / many:.1f} tok/s ({batch * one / many:.2f}x)", file=sys.stderr, flush=True)
    print(f"\nconfig {config}, greedy, {batch} rows against 1, {prompt_tokens}-token prompts, {new_tokens} steps "
          f"timed, {reps} timings of each in a process, {rounds} process(es) per cell; llama_cpp_python "
          f"{_version('llama_cpp_python')}; this library's int4 in groups of {int4_group_size}, int8/int4 with "
          f"{quant_dtype} activations")
    print("\n".join(batch_table(results, batch)))
    print(f"\n(whole run: {(time.perf_counter() - started) / 60:.1f} min)")


def batch_table(results: dict[tuple[str, str, int], list[dict]], batch: int) -> list[str]:
    """The lines of ``peers_batch``'s table: per engine x precision x threads, the tok/s of one row
    and of ``batch`` rows (medians [ranges] over processes, each the median of its timings), what
    the batch gains (``batch`` x one row's step time / the batch's, per process), and this
    library's batch tok/s over llama.cpp's."""
    def rates(runs: list[dict], rows: int) -> list[float]:
        return [rows / statistics.median(run["step_s"][str(rows)]) for run in runs]

    lines = [f"| engine | precision | threads | 1 row tok/s | {batch} rows tok/s | {batch} rows / 1 row "
             f"| {batch} rows / llama.cpp's |", "|---|---|---:|---:|---:|---:|---:|"]
    for p, t in sorted({(p, t) for _, p, t in results}, key=lambda c: (c[1], peers.PRECISIONS.index(c[0]))):
        for e in ("llama", "llama-compiled", "llama.cpp"):
            runs = results.get((e, p, t))
            if not runs:
                continue
            one, many = rates(runs, 1), rates(runs, batch)
            gain = [m / o for o, m in zip(one, many)]
            peer = results.get(("llama.cpp", p, t))
            versus = (f"{statistics.median(many) / statistics.median(rates(peer, batch)):.2f}"
                      if peer and e != "llama.cpp" else "-")
            lines.append(f"| {e} | {peers.GGUF_TYPES[p] if e == 'llama.cpp' else p} | {t} | {fmt_range(one)} "
                         f"| {fmt_range(many)} | {fmt_range(gain, digits=2)} | {versus} |")
    return lines


def peer_table(results: dict[tuple[str, str, int], list[dict]], bandwidth: dict[int, float], new_tokens: int,
               check_tokens: int, int4_group_size: int = 64) -> list[str]:
    """The table's lines: one row per engine x precision x threads (medians [ranges] over rounds),
    with this library's ratios to each peer in its own row."""
    def stats(runs: list[dict]) -> dict:
        decode = [new_tokens / (r["long_s"] - r["short_s"]) for r in runs]
        prefill = [r["prefill_prompt_tokens"] / r["prefill_s"] for r in runs]
        return dict(decode=decode, prefill=prefill, step=1 / statistics.median(decode),
                    weight_bytes=runs[0]["weight_bytes"], model=statistics.median(r["model_bytes"] for r in runs),
                    ids=runs[0]["agree_ids"])

    ours_label = lambda p: {"int4": f"int4 g{int4_group_size}"}.get(p, p)  # noqa: E731
    label = {"llama": ours_label, "llama-compiled": ours_label,
             "llama.cpp": lambda p: peers.GGUF_TYPES[p], "transformers": lambda p: p}
    lines = ["| engine | precision | threads | decode tok/s | prefill tok/s | % roofline | model MiB "
             "| greedy = llama | llama / llama.cpp | llama / transformers |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    cells = sorted({(p, t) for _, p, t in results}, key=lambda c: (c[1], peers.PRECISIONS.index(c[0])))
    for p, t in cells:
        row = {e: stats(results[(e, p, t)]) for e in peers.ENGINES if (e, p, t) in results}
        for e, s in row.items():
            ratios = []
            for peer in ("llama.cpp", "transformers"):
                if e in peers.OURS and peer in row:
                    ratios.append(f"{statistics.median(s['decode']) / statistics.median(row[peer]['decode']):.2f} / "
                                  f"{statistics.median(s['prefill']) / statistics.median(row[peer]['prefill']):.2f}")
                else:
                    ratios.append("-")
            same = (f"{_same_prefix(s['ids'], row['llama']['ids'])}/{check_tokens}"
                    if e != "llama" and "llama" in row else "-")  # every other row, llama-compiled too, against eager
            roofline = 100 * s["weight_bytes"] / bandwidth[t] / s["step"]
            lines.append(f"| {e} | {label[e](p)} | {t} | {fmt_range(s['decode'])} "
                         f"| {statistics.median(s['prefill']):.0f} | {roofline:.0f} | {s['model'] / 2**20:.0f} "
                         f"| {same} | {ratios[0]} | {ratios[1]} |")
    lines += ["", "decode tok/s: median [min-max] over rounds; ratios: decode / prefill, medians; greedy = llama: "
              f"identical leading tokens of {check_tokens} greedy ones against this library at the same precision; "
              "% roofline: (bytes of weights a decode step reads / measured bandwidth) / step time; model MiB: "
              "resident memory after loading and a warm-up, minus before loading"]
    return lines


def as_list(value) -> list:
    """A fire argument given as "a,b", ("a", "b") or a single value, as a list."""
    if isinstance(value, str):
        return [v for v in value.split(",") if v]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _ids(ids: list[int], most: int = 20) -> str:
    return " ".join(map(str, ids[:most])) + (" ..." if len(ids) > most else "")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    fire.Fire({"decode": main, "ragged_prefill": ragged_prefill, "batch_scaling": batch_scaling,
               "int8_agreement": int8_agreement, "peers": compare_peers, "peers_batch": compare_peers_batch,
               "sampling": sampling,
               "step_anatomy": step_anatomy, "live_length": live_length})
