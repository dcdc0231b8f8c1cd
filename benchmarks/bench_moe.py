"""Llama 4 mixture of experts: grouped expert compute against dense expert compute.

Grouped (this library): tokens are sorted by the expert the router chose and each
expert runs once on just its tokens.  Dense (Meta's reference): every token goes through
every expert, scaled by a router gate that is 0 for the experts not chosen.  Both run
in the same model, on the same random weights, interleaved repetition by repetition;
the model's MoE layers are switched between the two with ``MoE.expert_compute``.

    python benchmarks/bench_moe.py                                   # Scout-like mini model, CPU float32
    python benchmarks/bench_moe.py --config maverick-mini --threads 2
    python benchmarks/bench_moe.py --device cuda --dtype bfloat16 --config scout-layer

Columns:
  step       decode B: one decoding step for B rows at position ``--context``;
             prefill T: one forward pass over a T-token prompt (batch 1)
  ms         median [min-max] over ``--repeats`` timed repetitions (after 2 warm-ups)
  tok/s      tokens processed per second at the median
  speed-up   dense median / grouped median
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import fire
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llama import ModelArgs  # noqa: E402
from llama.layers.moe import MoE  # noqa: E402
from llama.model import Transformer  # noqa: E402
from llama.runtime import distributed  # noqa: E402

CONFIGS = {
    # Scout's proportions shrunk: 16 experts, top-1, every layer MoE, chunked attention.
    "scout-mini": dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=2, multiple_of=256, ffn_dim_multiplier=1.2,
                       ffn_exp=4.0, moe_args=dict(num_experts=16, top_k=1, interleave_moe_layer_step=1),
                       attention_chunk_size=128, nope_layer_interval=4, use_qk_norm=True, rope_theta=500000.0),
    # Maverick's: 128 experts, MoE on every other layer.
    "maverick-mini": dict(dim=512, n_layers=4, n_heads=8, n_kv_heads=2, multiple_of=256, ffn_dim_multiplier=1.2,
                          ffn_exp=4.0, moe_args=dict(num_experts=128, top_k=1, interleave_moe_layer_step=2),
                          attention_chunk_size=128, nope_layer_interval=4, rope_theta=500000.0),
    # One layer of Scout at full width (dim 5120, 16 experts of 8192): for a GPU.
    "scout-layer": dict(dim=5120, n_layers=1, n_heads=40, n_kv_heads=8, multiple_of=2048, ffn_dim_multiplier=1.2,
                        ffn_exp=4.0, moe_args=dict(num_experts=16, top_k=1, interleave_moe_layer_step=1),
                        attention_chunk_size=8192, use_qk_norm=True, rope_theta=500000.0),
}


def build(config: str, device: torch.device, dtype: torch.dtype, vocab: int, max_seq_len: int, batch: int):
    params = {**CONFIGS[config], "vocab_size": vocab, "max_seq_len": max_seq_len, "max_batch_size": batch}
    args = ModelArgs.from_dict(params)
    distributed.init_model_parallel(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5 if "experts.w" not in name else p.shape[-2] ** -0.5)
            p.data = p.data.to(dtype)  # parameters only: the RoPE table stays complex
    model.setup_rope(device)
    return model.eval(), args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(
    config: str = "scout-mini",
    device: str = "cpu",
    dtype: str = "float32",
    threads: int = 1,
    batches: tuple = (1, 8),
    prompt: int = 256,
    context: int = 200,
    repeats: int = 7,
    vocab: int = 8192,
) -> None:
    """Print decode and prefill times of grouped vs dense expert compute."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    batches = tuple(batches) if isinstance(batches, (list, tuple)) else (int(batches),)
    model, args = build(config, dev, dt, vocab, max(prompt, context) + 8, max(batches))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    g = torch.Generator().manual_seed(0)

    def set_mode(mode: str) -> None:
        for m in moes:
            m.expert_compute = mode

    cases = []
    for b in batches:
        tokens = torch.randint(0, vocab, (b, 1), generator=g).to(dev)
        positions = torch.full((b, 1), context, device=dev)
        cases.append((f"decode B={b}", b,
                      lambda t=tokens, p=positions: model.decode_logits(t, p, context + 1, model.forward_cache())))
    ptoks = torch.randint(0, vocab, (1, prompt), generator=g).to(dev)
    ppos = torch.arange(prompt, device=dev).unsqueeze(0)
    cases.append((f"prefill T={prompt}", prompt,
                  lambda: model.logits(model.hidden_states(ptoks, ppos, prompt, model.forward_cache(),
                                                           from_start=True)[:, -1])))

    times: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for name, _, fn in cases:
            for mode in ("grouped", "dense"):
                set_mode(mode)
                for _ in range(2):
                    fn()
            for _ in range(repeats):  # interleaved: grouped, dense, grouped, dense, ...
                for mode in ("grouped", "dense"):
                    set_mode(mode)
                    sync(dev)
                    start = time.perf_counter()
                    fn()
                    sync(dev)
                    times.setdefault((name, mode), []).append(time.perf_counter() - start)
    set_mode("grouped")

    n_params = sum(p.numel() for p in model.parameters())
    moe_args = args.moe_args
    print(f"config {config}: dim {args.dim}, {args.n_layers} layers, {moe_args.num_experts} experts "
          f"(width {args.moe_hidden_dim}, top-{moe_args.top_k}), {n_params / 1e6:.0f}M parameters; "
          f"{device} {dtype}, {threads} thread(s), {repeats} repetitions, decode at position {context}")
    print(f"| {'step':<16} | {'grouped ms':>22} | {'dense ms':>22} | {'grouped tok/s':>13} | {'dense tok/s':>11} "
          f"| speed-up |")
    print(f"|{'-' * 18}|{'-' * 24}|{'-' * 24}|{'-' * 15}|{'-' * 13}|{'-' * 10}|")

    def cell(ts: list[float]) -> str:
        return f"{statistics.median(ts) * 1e3:8.2f} [{min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}]"

    for name, n_tokens, _ in cases:
        gr, de = times[(name, "grouped")], times[(name, "dense")]
        gm, dm = statistics.median(gr), statistics.median(de)
        print(f"| {name:<16} | {cell(gr):>22} | {cell(de):>22} | {n_tokens / gm:13.1f} | {n_tokens / dm:11.1f} "
              f"| {dm / gm:7.2f}x |")


if __name__ == "__main__":
    fire.Fire(main)
