"""LoRA adapters served unmerged on the CPU: what they cost against a merged model, and what
mixing adapters in one batch costs against one adapter.

    python benchmarks/bench_lora.py                       # the issue's table: 150m, bfloat16, rank 16
    python benchmarks/bench_lora.py --config tiny --new_tokens 4 --reps 1 --no-compile   # a dry run

One process builds two engines over the same seeded random weights (:data:`common.CONFIGS`'s
shape, Llama 3's vocabulary, ``--dtype``), both with the engine's defaults (compiled where
``Llama.build`` compiles: bfloat16 on a CPU with a C++ compiler; ``--no-compile`` turns it off):

- *unmerged*: the base serving 4 random adapters of rank ``--rank`` on all seven target layers
  (``max_batch_size`` 8);
- *merged*: the base with the first adapter folded into its weights (``W + scale * B @ A``;
  ``max_batch_size`` 1).

Each round then times, one after the other (interleaved, so that a busy machine's slow moments
fall on every row alike), greedy requests of random ``--prompt_len``-token prompts:

1. one request with the first adapter, unmerged; 2. the same request on the merged model;
3. eight requests over the 4 adapters (two each), unmerged; 4. eight requests all with the
   first adapter, unmerged.

decode tok/s = rows x N / (time of N + 1 new tokens - time of 1).  The table gives each row's
median [min-max] over ``--reps`` rounds and the two ratios the issue sets targets for (the median
over rounds of each round's ratio): batch 1 unmerged / merged (target >= 0.9x), batch 8 over 4
adapters / over one (target >= 0.8x); and the adapters' load time, two ways:

- *from PEFT's files*: the unmerged engine is built from the 4 adapters saved as PEFT saves them
  (``adapter_config.json`` and ``adapter_model.safetensors``, Hugging Face's names and q/k row
  order, in a temporary folder): from reading the files to every adapter ready to serve (read,
  checked, mapped to Meta's names, written into the model's LoRA layers: what
  ``ServedAdapters.load_seconds`` counts), with the reading alone (:func:`read_adapter` of each)
  timed apart;
- *from memory*: the same adapters, already read, written into their slots again (the copy
  alone: their slices, padded to the rank).

Runtime with the defaults (``--reps 3``, ``--new_tokens 32``): estimated at about 5 minutes on 2
quiet cores with an empty Inductor cache (compiling the two engines' 5 decoding shapes is most of
it), less once the cache holds them.  Measured only on a machine loaded about eight times over,
the script at low priority: 31 minutes of wall time for 357 s of CPU time (user and system), the
engines built in 655 s and 161 s; its rates there (0.3 to 3.9 tok/s) say nothing of the CPU's.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import CONFIGS, LLAMA3_VOCAB, llama3_tokenizer, random_weights, rate_past_first_token, set_threads  # noqa: E402
from llama import Llama, ModelArgs  # noqa: E402
from llama.convert.names import META_TO_HF_NAMES, ROPE_PERMUTED, meta_to_hf_rope_rows  # noqa: E402
from llama.engine import RequestSettings  # noqa: E402
from llama.engine.lora import load_lora_adapters  # noqa: E402
from llama.lora.adapter import LoraAdapter, LoraFactors, read_adapter  # noqa: E402
from llama.model import Transformer  # noqa: E402

TARGETS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
N_ADAPTERS = 4
BATCH = 8


def random_adapters(state: dict[str, torch.Tensor], n_layers: int, rank: int, n: int = N_ADAPTERS,
                    scale: float = 2.0) -> dict[str, LoraAdapter]:
    """``n`` seeded random adapters of ``rank`` on every target layer (float32 factors whose
    change is of the order of a tenth of the weights')."""
    adapters = {}
    for k in range(n):
        g = torch.Generator().manual_seed(100 + k)
        factors = {}
        for i in range(n_layers):
            for target in TARGETS:
                out_f, in_f = state[f"layers.{i}.{target}.weight"].shape
                a = torch.randn(rank, in_f, generator=g) / in_f**0.5
                b = torch.randn(out_f, rank, generator=g) * (0.1 / (scale * rank**0.5))
                factors[f"layers.{i}.{target}"] = LoraFactors(a, b)
        name = f"adapter{k}"
        adapters[name] = LoraAdapter(name=name, path=Path(f"/random/{name}"), rank=rank, scale=scale, factors=factors)
    return adapters


def save_peft(adapter: LoraAdapter, folder: Path, args: ModelArgs) -> Path:
    """``adapter`` written as PEFT's ``save_pretrained`` writes a LoRA adapter: its config and its
    factors under transformers' names, B's rows of q_proj/k_proj in Hugging Face's rotary order."""
    from safetensors.torch import save_file

    tensors = {}
    for name, f in adapter.factors.items():
        layer = name.split(".")[1]
        pattern = name.replace(f".{layer}.", ".*.", 1) + ".weight"
        hf = META_TO_HF_NAMES[pattern].replace("*", layer).removesuffix(".weight")
        b = f.b
        if pattern in ROPE_PERMUTED:
            b = meta_to_hf_rope_rows(b, getattr(args, ROPE_PERMUTED[pattern]))
        tensors[f"base_model.model.{hf}.lora_A.weight"] = f.a.contiguous()
        tensors[f"base_model.model.{hf}.lora_B.weight"] = b.contiguous()
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    modules = sorted({key.split(".")[-3] for key in tensors})
    config = {"peft_type": "LORA", "r": adapter.rank, "lora_alpha": adapter.scale * adapter.rank,
              "target_modules": modules, "bias": "none", "use_rslora": False, "use_dora": False}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def merged_state(state: dict[str, torch.Tensor], adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    out = dict(state)
    for name, f in adapter.factors.items():
        key = f"{name}.weight"
        out[key] = (state[key].float() + adapter.scale * f.b @ f.a).to(state[key].dtype)
    return out


def build(args: ModelArgs, state: dict[str, torch.Tensor], compile: Optional[bool], **kw) -> Llama:
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(state, assign=True)
    model.setup_rope()
    return Llama(model, llama3_tokenizer(), compile=compile, **kw)


def decode_rate(llama: Llama, prompts: Sequence[list[int]], loras: Sequence[Optional[str]], new_tokens: int) -> float:
    """Decode tok/s of ``prompts`` together, each with its adapter: (N + 1 tokens) - (1 token)
    (common.rate_past_first_token)."""
    def timed(n: int) -> float:
        start = time.perf_counter()
        handles = [llama.engine.submit(p, RequestSettings(max_new_tokens=n, temperature=0, stop_tokens=frozenset(),
                                                          lora=lora))
                   for p, lora in zip(prompts, loras)]
        for h in handles:
            h.result()
        return time.perf_counter() - start

    return rate_past_first_token(timed, new_tokens, len(prompts))


def fmt(values: Sequence[float], digits: int = 1) -> str:
    v = sorted(values)
    return f"{statistics.median(v):.{digits}f} [{v[0]:.{digits}f}-{v[-1]:.{digits}f}]"


def run(config: str = "150m", dtype: str = "bfloat16", rank: int = 16, threads: int = 2, prompt_len: int = 16,
        new_tokens: int = 32, reps: int = 3, compile: Optional[bool] = None) -> dict:
    """Builds the two engines and measures (see the module's docstring); the measurements as a dict
    (``rows``: tok/s per round by row; ``ratios``; ``load_s``; ``build_s``)."""
    set_threads(threads)
    max_seq_len = prompt_len + new_tokens + 8
    torch_dtype = getattr(torch, dtype)
    args = ModelArgs(**CONFIGS[config], vocab_size=LLAMA3_VOCAB, max_seq_len=max_seq_len, max_batch_size=BATCH)
    _, state = random_weights(args, torch.float32)
    adapters = random_adapters(state, args.n_layers, rank)
    first = next(iter(adapters))
    merged = {k: v.to(torch_dtype) for k, v in merged_state(state, adapters[first]).items()}
    state = {k: v.to(torch_dtype) for k, v in state.items()}
    files = tempfile.TemporaryDirectory(prefix="bench_lora-")
    folders = {name: save_peft(adapter, Path(files.name) / name, args) for name, adapter in adapters.items()}
    start = time.perf_counter()
    unmerged = build(args, state, compile, lora_adapters=folders)  # from PEFT's files
    built_unmerged = time.perf_counter() - start
    lora = unmerged.engine.lora
    assert lora is not None
    start = time.perf_counter()
    for name, folder in folders.items():
        read_adapter(folder, args, name=name)
    read_s = time.perf_counter() - start
    files.cleanup()
    # the same adapters from memory: written into their slots again (the copy alone)
    copy_s = load_lora_adapters(unmerged.model, unmerged.model.params, adapters).load_seconds
    start = time.perf_counter()
    args1 = ModelArgs(**CONFIGS[config], vocab_size=LLAMA3_VOCAB, max_seq_len=max_seq_len, max_batch_size=1)
    merged_llama = build(args1, merged, compile)
    built_merged = time.perf_counter() - start
    print(f"engines built in {built_unmerged:.0f} s (unmerged, {N_ADAPTERS} adapters) and {built_merged:.0f} s "
          f"(merged); compiled: {unmerged.compiled}", file=sys.stderr, flush=True)

    g = torch.Generator().manual_seed(3)
    vocab = min(unmerged.tokenizer.n_words, unmerged.model.vocab_size)
    prompts = [[unmerged.tokenizer.bos_id] + torch.randint(3, vocab, (prompt_len - 1,), generator=g).tolist()
               for _ in range(BATCH)]
    names = list(adapters)
    rows: dict[str, list[float]] = {"b1_unmerged": [], "b1_merged": [], "b8_mixed": [], "b8_one": []}
    for r in range(reps):
        rows["b1_unmerged"].append(decode_rate(unmerged, prompts[:1], [first], new_tokens))
        rows["b1_merged"].append(decode_rate(merged_llama, prompts[:1], [None], new_tokens))
        rows["b8_mixed"].append(decode_rate(unmerged, prompts, [names[i % N_ADAPTERS] for i in range(BATCH)],
                                            new_tokens))
        rows["b8_one"].append(decode_rate(unmerged, prompts, [first] * BATCH, new_tokens))
        print(f"round {r + 1}/{reps}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()),
              file=sys.stderr, flush=True)
    ratios = {"b1": [u / m for u, m in zip(rows["b1_unmerged"], rows["b1_merged"])],
              "b8": [x / o for x, o in zip(rows["b8_mixed"], rows["b8_one"])]}
    return {"config": config, "dtype": dtype, "rank": rank, "threads": threads, "new_tokens": new_tokens,
            "reps": reps, "compiled": unmerged.compiled, "rows": rows, "ratios": ratios,
            "load_s": lora.load_seconds, "read_s": read_s, "copy_s": copy_s,
            "build_s": [built_unmerged, built_merged]}


def table(result: dict) -> str:
    rows, ratios = result["rows"], result["ratios"]
    head = (f"{result['config']}, {result['dtype']}, rank {result['rank']}, {result['threads']} thread(s), "
            f"compiled: {result['compiled']}; decode tok/s, median [min-max] of {result['reps']} interleaved rounds")
    lines = [head, "", "| run | tok/s | ratio (median [range]) | target |", "|---|---|---|---|",
             f"| batch 1, one adapter, unmerged | {fmt(rows['b1_unmerged'])} | {fmt(ratios['b1'], 2)}x of merged "
             "| >= 0.9x |",
             f"| batch 1, the same adapter merged | {fmt(rows['b1_merged'])} | | |",
             f"| batch 8 over {N_ADAPTERS} adapters | {fmt(rows['b8_mixed'])} | {fmt(ratios['b8'], 2)}x of one adapter "
             "| >= 0.8x |",
             f"| batch 8, one adapter | {fmt(rows['b8_one'])} | | |",
             "", f"adapter load ({N_ADAPTERS} adapters of rank {result['rank']}): from PEFT's files to ready to serve "
                 f"{result['load_s']:.2f} s (reading the files {result['read_s']:.2f} s); from memory into the LoRA "
                 f"layers {result['copy_s']:.2f} s"]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="150m", choices=sorted(CONFIGS))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decoding steps (default: the engine's default)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(config=a.config, dtype=a.dtype, rank=a.rank, threads=a.threads, prompt_len=a.prompt_len,
                 new_tokens=a.new_tokens, reps=a.reps, compile=a.compile)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
