"""Worker started by tests under torchrun: build, run a fixed workload, save the results.

Usage: torchrun --standalone --nproc_per_node N tests/mp_worker.py CKPT TOKENIZER OUT_DIR [QUANTIZE]
   or: torchrun --standalone --nproc_per_node N tests/mp_worker.py --plan PLAN_JSON
PLAN_JSON holds a list of [CKPT, TOKENIZER, OUT_DIR, QUANTIZE]: the same processes build each
checkpoint in turn (one job, several checkpoints), each written as the first form writes it.
Each rank seeds its sampler differently on purpose: ranks must still agree, because
the first rank decides every token and shares it.
"""

import gc
import json
import sys
import threading
from pathlib import Path

import torch

from llama import Llama
from llama.engine import RequestSettings
from llama.layers.packed import PackedWeight
from llama.runtime.distributed import model_parallel_rank


def ban_token(banned: int):
    def processor(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        logits[:, banned] = float("-inf")
        return logits

    return processor


def served(llama: Llama, prompts: list[list[int]]):
    """Server mode: every rank runs the engine loop; requests arrive on the first rank
    only, from another thread (as an HTTP server's would)."""
    engine, stop, out = llama.engine, threading.Event(), {}
    client = None
    if model_parallel_rank() == 0:
        def submit_all() -> None:
            try:
                handles = [engine.submit(p, RequestSettings(max_new_tokens=8, temperature=0)) for p in prompts]
                out["tokens"] = [h.result().tokens for h in handles]
            finally:
                stop.set()

        client = threading.Thread(target=submit_all)
        client.start()
    engine.run_forever(stop)
    if client is not None:
        client.join()
    return out.get("tokens")


def isolated_failure(llama: Llama, prompts: list[list[int]]) -> dict:
    """A request whose logits processor raises at its second token (on the first rank, where
    processors run) beside one that does not: the first fails on every rank, the other
    finishes."""
    calls = []

    def fails(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("the processor failed")
        return logits

    engine = llama.engine
    bad = engine.submit(prompts[0], RequestSettings(max_new_tokens=6, temperature=0, logits_processor=fails))
    good = engine.submit(prompts[1], RequestSettings(max_new_tokens=6, temperature=0))
    try:
        bad.result()
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "bystander": good.result().tokens}


def deferred_masks(llama: Llama, prompt: list[int]) -> dict:
    """Two constrained requests, the masks of one slowed past the step's budget (deferred on the
    first rank, where masks are computed; its logits held on every rank until it is sampled),
    and a free one: the tokens, and how many held rows each rank sampled (the same on every
    rank: they learn of deferrals from the first rank's tokens)."""
    import time

    from llama.structured import GrammarMasker

    slow = llama._grammar({"type": "regex", "regex": "[a-z ]{10}"})
    fast = llama._grammar({"type": "regex", "regex": "(yes|no|maybe)[.!]"})
    engine, fill, released = llama.engine, GrammarMasker.fill, []

    def slowed(self, matchers, **kw):
        if any(m.grammar is slow for m in matchers):
            # Masks are made while the model runs: the delay must outlast a step's forward pass
            # (4 processes on 2 busy cores: tens of ms), or the mask is ready in time and nothing
            # is deferred on the first rank.
            time.sleep(0.2)
        return fill(self, matchers, **kw)

    take_held, budget = engine.sampler.take_held, engine.sampler.mask_budget_s

    def counting(*args):
        out = take_held(*args)
        released.append(len(out[0]))
        return out

    GrammarMasker.fill, engine.sampler.take_held, engine.sampler.mask_budget_s = slowed, counting, 0.01
    try:
        handles = [engine.submit(prompt, RequestSettings(max_new_tokens=12, temperature=1.0, seed=7, grammar=slow)),
                   engine.submit(prompt, RequestSettings(max_new_tokens=12, temperature=1.0, seed=8, grammar=fast)),
                   engine.submit(prompt, RequestSettings(max_new_tokens=12, temperature=0))]
        tokens = [h.result().tokens for h in handles]
    finally:
        GrammarMasker.fill, engine.sampler.take_held, engine.sampler.mask_budget_s = fill, take_held, budget
    return {"tokens": tokens, "released": sum(released)}


def prioritised(llama: Llama, prompts: list[list[int]]) -> list[list[int]]:
    """Four greedy requests of different priorities made at once (three rows): the first rank
    admits them in priority order, not in the order every rank made them, and the other ranks
    must match each admission to its own request."""
    engine = llama.engine
    handles = [engine.submit(p, RequestSettings(max_new_tokens=6, temperature=0, priority=priority))
               for p, priority in zip(prompts + prompts[:1], (5, 0, -1, 2))]
    return [h.result().tokens for h in handles]


def workload(llama: Llama) -> dict:
    vocab = llama.model.vocab_size
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    prompts = [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 11, 7)]
    return {
        "logits": llama.model.forward(tokens, 0),
        "greedy": llama.generate(prompts, max_gen_len=16, temperature=0)[0],
        "sampled": llama.generate(prompts, max_gen_len=16, temperature=1.0, top_p=0.95)[0],
        "text": llama.text_completion(["the cat", "Hello"], max_gen_len=8, temperature=0),
        "processed": llama.generate(prompts, max_gen_len=8, temperature=0, logits_processor=ban_token(5))[0],
        "isolated": isolated_failure(llama, prompts),
        "deferred": deferred_masks(llama, prompts[0]),
        "prioritised": prioritised(llama, prompts),
        "served": served(llama, prompts),
        "after_serving": llama.generate(prompts, max_gen_len=4, temperature=0)[0],
    }


def quantized_workload(llama: Llama) -> dict:
    tokens = torch.randint(0, llama.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    return {"logits": llama.model.forward(tokens, 0),
            "one_row": llama.model.forward(tokens[:1, :1], 0),  # one-row products (w8a8's own path)
            "greedy": llama.generate([[1, 5, 9], [1, 12, 13, 14]], max_gen_len=12, temperature=0)[0]}


def main(ckpt: str, tokenizer: str, out_dir: str, quantize: str = "") -> None:
    import os

    rank = int(os.environ.get("RANK", 0))
    if quantize in ("bfloat16", "float16"):  # a low-precision dtype rather than quantised weights
        options = dict(dtype=quantize)
    else:
        options = dict(quantize=quantize) if quantize else {}
        if quantize == "int4":
            options["quantize_group_size"] = 32
        if quantize == "w8a8":
            options["dtype"] = "bfloat16"
    llama = Llama.build(ckpt, tokenizer, max_seq_len=64, max_batch_size=3, device="cpu", seed=100 + rank, **options)
    result = quantized_workload(llama) if quantize else workload(llama)
    result["packed"] = sum(isinstance(m, PackedWeight) for m in llama.model.modules())
    result["rank"] = model_parallel_rank()
    # where torchrun put this process: its agent's node rank and how many processes that agent ran
    result["node"] = (os.environ.get("GROUP_RANK"), os.environ.get("LOCAL_WORLD_SIZE"))
    result["compiler_imported"] = "torch._dynamo" in sys.modules  # (tests run eager: LLAMA_COMPILE=0)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_plan(plan_json: str) -> None:
    for ckpt, tokenizer, out_dir, quantize in json.loads(Path(plan_json).read_text()):
        main(ckpt, tokenizer, out_dir, quantize)
        gc.collect()  # the last model's weights and caches, before the next is loaded


if __name__ == "__main__":
    if sys.argv[1] == "--plan":
        run_plan(sys.argv[2])
    else:
        main(*sys.argv[1:5])
