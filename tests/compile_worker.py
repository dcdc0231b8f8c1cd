"""Worker started by tests under torchrun: build each checkpoint with ``compile=True`` and
n-gram speculation, serve requests in changing batch sizes (speculating, then not), and save
what torch.compile did.

Usage: torchrun --standalone --nproc_per_node N tests/compile_worker.py TOKENIZER OUT_DIR CKPT [CKPT ...]
Writes OUT_DIR/rankR.json: per checkpoint, the graph breaks and graphs made while building
(the warm-up) and after it, the greedy tokens of each batch (speculating, and not), the
tokens proposed and accepted, and how many verifications there were and ran compiled.
"""

import itertools
import json
import os
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from llama import Llama
from llama.engine import RequestSettings

SPECULATIVE = {"method": "ngram", "num_tokens": 4}
BATCHES = [[[1, 5, 9]], [[1, 5, 9], [1, 2], [3, 4, 5, 6, 7]], [[1, 2], [7, 7, 7, 7]], [[1, 5, 9]]]
# A prompt past the first context bucket (256): 301 tokens, and 12 generated, within the
# second and last one (MAX_SEQ_LEN)
LONG_PROMPT = [1] + [5 + i % 50 for i in range(300)]
MAX_SEQ_LEN = 320


def looping_prompt(llama: Llama) -> list[int]:
    """A prompt, its model's greedy reply, the prompt again: prompt lookup proposes the reply
    again, and the model (these random ones) agrees with some of it.  The reply is generated
    without speculation, so that no rejected proposal lowers the acceptance the engine's next
    requests start from (llama.engine.speculative)."""
    start = [7, 7, 7, 7]
    reply = llama.engine.submit(start, RequestSettings(max_new_tokens=8, temperature=0, speculative=False))
    return start + reply.result().tokens + start[1:]


def batches(llama: Llama) -> list[list[list[int]]]:
    """What the worker generates, in order: the looping prompt first (a request starts from the
    engine's recent acceptance: after the others' rejected proposals it would start paused), then
    batches of 1 to 3 rows, then a prompt past the first context bucket."""
    return [[looping_prompt(llama)]] + BATCHES + [[LONG_PROMPT]]


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def breaks() -> int:
    return sum(counters["graph_break"].values())


def main(tokenizer: str, out_dir: str, *ckpts: str) -> None:
    results = []
    for ckpt in ckpts:
        torch._dynamo.reset()
        counters.clear()
        llama = Llama.build(ckpt, tokenizer, max_seq_len=MAX_SEQ_LEN, max_batch_size=4, device="cpu", compile=True,
                            speculative=SPECULATIVE)
        at_build = {"graphs": graphs(), "breaks": breaks()}
        # The speculative rule times steps by a clock that counts its reads (every step takes 1), so
        # what each step proposes does not depend on how busy the machine is, and the two ranks agree.
        llama.engine.speculator.clock = itertools.count().__next__
        runner, verifications = llama.engine.runner, {"all": 0, "compiled": 0}
        verify, verify_step = runner._verify, runner.verify_step

        def counting_verify(feeding, proposals):
            verifications["all"] += 1
            return verify(feeding, proposals)

        def counting_step(*args):
            verifications["compiled"] += 1
            return verify_step(*args)

        runner._verify, runner.verify_step = counting_verify, counting_step
        prompts = batches(llama)
        tokens = [llama.generate(batch, max_gen_len=12, temperature=0)[0] for batch in prompts]
        plain = []  # every step without proposals: the compiled decoding step in each batch's rows
        for batch in prompts:
            handles = [llama.engine.submit(p, RequestSettings(max_new_tokens=12, temperature=0, speculative=False))
                       for p in batch]
            plain.append([h.result().tokens for h in handles])
        stats = llama.engine.stats()
        results.append({"at_build": at_build, "graphs_after": graphs() - at_build["graphs"],
                        "breaks_after": breaks() - at_build["breaks"], "compiled": llama.compiled,
                        "tokens": tokens, "plain": plain, "verifications": verifications,
                        "proposed": stats["spec_proposed_tokens_total"],
                        "accepted": stats["spec_accepted_tokens_total"]})
    Path(out_dir, f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
