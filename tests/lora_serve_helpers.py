"""LoRA adapters made in memory for the serving tests: random factors in Meta's names for a test
checkpoint's full weights, and the merged weights ``W + scale * B @ A`` they stand for (the
independent reference: a plain model with those weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from llama.lora.adapter import LoraAdapter, LoraFactors

ALL_TARGETS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
               "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def random_adapter(name: str, weights: dict[str, torch.Tensor], n_layers: int, rank: int,
                   targets: Sequence[str] = ALL_TARGETS, seed: int = 0, scale: float = 2.0) -> LoraAdapter:
    """An adapter of ``rank`` changing ``targets`` of every layer, with random A and B (both
    non-zero, unlike PEFT's initial B: a test of them can fail), sized so that the change is of
    the order of the weights' own effect."""
    g = torch.Generator().manual_seed(seed)
    factors = {}
    for i in range(n_layers):
        for target in targets:
            out_f, in_f = weights[f"layers.{i}.{target}.weight"].shape
            a = torch.randn(rank, in_f, generator=g) / in_f**0.5
            b = torch.randn(out_f, rank, generator=g) / (rank**0.5 * scale) * 0.7
            factors[f"layers.{i}.{target}"] = LoraFactors(a, b)
    return LoraAdapter(name=name, path=Path(f"/in-memory/{name}"), rank=rank, scale=scale, factors=factors)


def merged_weights(weights: dict[str, torch.Tensor], adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    """``weights`` with ``adapter`` folded in: ``W + scale * B @ A`` for every layer it changes
    (in float64, then float32)."""
    out = dict(weights)
    for name, f in adapter.factors.items():
        key = f"{name}.weight"
        out[key] = (weights[key].double() + adapter.scale * f.b.double() @ f.a.double()).float()
    return out


def mixed_batch(llama, prompts: list[list[int]], names: list, columns: int) -> tuple[list[list[int]], torch.Tensor]:
    """(the greedy tokens of ``prompts``, each with its adapter in ``names`` (None: the base), as one
    batch of the engine; the logits (rows, ``columns``, V) of one forward pass of random tokens with
    the same adapters, on this process's share of the model)."""
    from llama.engine import RequestSettings

    handles = [llama.engine.submit(p, RequestSettings(max_new_tokens=8, temperature=0, lora=name))
               for p, name in zip(prompts, names)]
    tokens = [h.result().tokens for h in handles]
    model, rows = llama.model, len(names)
    x = torch.randint(0, 200, (rows, columns), generator=torch.Generator().manual_seed(0))
    slots = torch.tensor([llama.engine.lora_slot(name) for name in names])
    with torch.inference_mode():
        logits = model.logits(model.hidden_states(x, torch.arange(columns).expand(rows, columns), columns,
                                                  model.new_kv_cache(rows), from_start=True, lora_slots=slots))
    return tokens, logits


def save_on_first_rank(out, tokens: list[list[int]], logits: torch.Tensor) -> None:
    """Write ``out``/tokens.json and ``out``/logits.pt from the first model-parallel rank."""
    import json
    from pathlib import Path

    from llama.runtime.distributed import model_parallel_rank

    if model_parallel_rank() == 0:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokens.json").write_text(json.dumps(tokens))
        torch.save(logits, out / "logits.pt")
