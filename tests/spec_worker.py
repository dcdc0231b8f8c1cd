"""Worker started by tests/test_speculative.py under torchrun: build with n-gram speculation,
run a fixed workload (constrained requests included), save the results.

Usage: torchrun --standalone --nproc_per_node N tests/spec_worker.py CKPT TOKENIZER OUT_DIR [DRAFT_DIR [LAYOUTS]]
(DRAFT_DIR: a draft model proposes, 3 tokens, instead of prompt lookup; LAYOUTS, "0" (default),
"1", "0,1" or with "ngram" among them: the draft whole on every rank (0) or sharded over the ranks
(1), or prompt lookup (ngram), one engine after the other in the same job, each one's results saved
as rank{R}-{LAYOUT}.pt, prompt lookup's as rank{R}.pt; without a draft: prompt lookup, rank{R}.pt.)
Each rank seeds its sampler differently on purpose: the ranks must still agree (every rank
computes the same proposals from the same tokens, and the first rank's choices are shared).
The rule's step times come from a clock that counts its reads (:func:`steady_clock`): every step
takes one unit on every process, so the first rank's shared costs, and with them every
proposal, are the same in one process and in two (real times would differ from run to run).
"""

import itertools
import sys
import threading
from pathlib import Path
from typing import Optional

import torch

from llama import Llama
from llama.engine import RequestSettings
from llama.runtime.distributed import model_parallel_rank

SPECULATIVE = {"method": "ngram", "num_tokens": 3}
# A grammar the first rank alone applies: the ranks must still feed the same proposals.
WORDS = {"type": "regex", "regex": "[a-z ]{1,60}"}


def prompts() -> list[list[int]]:
    """Prompts that repeat themselves (so that prompt lookup proposes) and one that does not."""
    loop = [1, 17, 23, 5, 88, 41, 9]
    return [loop * 3, [1, 4, 7, 4, 7, 4, 7, 12], [1, 30, 31, 32, 33, 34]]


def ban_token(banned: int):
    def processor(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        logits[:, banned] = float("-inf")
        return logits

    return processor


def served(llama: Llama) -> list:
    """Server mode: every rank runs the engine loop; requests arrive on the first rank only (a
    constrained one among them: the other ranks know it only from its admission)."""
    engine, stop, out = llama.engine, threading.Event(), {}
    client = None
    if model_parallel_rank() == 0:
        def submit_all() -> None:
            try:
                handles = [engine.submit(p, RequestSettings(max_new_tokens=20, temperature=0)) for p in prompts()]
                handles.append(engine.submit(prompts()[0], RequestSettings(max_new_tokens=20, temperature=0,
                                                                           grammar=llama._grammar(WORDS))))
                out["tokens"] = [h.result().tokens for h in handles]
            finally:
                stop.set()

        client = threading.Thread(target=submit_all)
        client.start()
    engine.run_forever(stop)
    if client is not None:
        client.join()
    return out.get("tokens")


def steady_clock():
    """A clock that counts its reads: every step the engine times takes 1 (llama.engine.speculative)."""
    return itertools.count().__next__


def workload(llama: Llama) -> dict:
    engine = llama.engine
    if engine.speculator is not None:
        engine.speculator.clock = steady_clock()

    def run(**settings) -> list[list[int]]:
        handles = [engine.submit(p, RequestSettings(**settings)) for p in prompts()]
        return [h.result().tokens for h in handles]

    def proposed() -> int:
        return engine.stats()["spec_proposed_tokens_total"]

    result = {
        "greedy": run(max_new_tokens=24, temperature=0),
        "sampled": run(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=5),
        "processed": run(max_new_tokens=16, temperature=0, logits_processor=ban_token(9)),
    }
    before = proposed()
    result["constrained"] = run(max_new_tokens=20, temperature=0, grammar=llama._grammar(WORDS))
    result["constrained_proposed"] = proposed() - before
    # Steps driven by the caller (above) see the requests arrive together; served ones arrive while
    # the loop runs, in groups that depend on timing, and the rows of a step decide what it may
    # propose: what is proposed up to here is the same in every process, what is proposed in all
    # the same on every rank of one job.
    stats = engine.stats()
    result["proposed"], result["accepted"] = stats["spec_proposed_tokens_total"], stats["spec_accepted_tokens_total"]
    result["served"] = served(llama)
    stats = engine.stats()
    result["proposed_all"] = stats["spec_proposed_tokens_total"], stats["spec_accepted_tokens_total"]
    return result


def main(ckpt: str, tokenizer: str, out_dir: str, draft: Optional[str] = None, layouts: str = "0") -> None:
    import os

    rank = int(os.environ.get("RANK", 0))
    for name in layouts.split(",") if draft is not None else ["ngram"]:
        layout = None if name == "ngram" else name
        speculative = SPECULATIVE if layout is None else {
            "method": "draft", "draft_ckpt_dir": draft, "num_tokens": 3,
            "draft_tensor_parallel_size": int(os.environ["WORLD_SIZE"]) if layout == "1" else 1}
        llama = Llama.build(ckpt, tokenizer, max_seq_len=64, max_batch_size=3, device="cpu", seed=100 + rank,
                            dtype="float32", speculative=speculative)
        result = workload(llama)
        result["rank"] = model_parallel_rank()
        torch.save(result, Path(out_dir) / (f"rank{rank}.pt" if layout is None else f"rank{rank}-{layout}.pt"))
        del llama


if __name__ == "__main__":
    main(*sys.argv[1:6])
