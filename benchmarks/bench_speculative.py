"""Speculative decoding on the CPU: what verifying proposed tokens costs and saves, by batch size.

    python benchmarks/bench_speculative.py cost --config 150m --dtype float32 --threads 1 --batches 1,2,4,8
    python benchmarks/bench_speculative.py rule --config 150m --dtype float32 --threads 2 --batches 1,2,4,8
    python benchmarks/bench_speculative.py rule --config demo --dtype float32 --threads 2
    python benchmarks/bench_speculative.py ngram --threads 2 --batches 1,4

``rule``: one engine (random weights of ``--config``'s shape with Llama 3's vocabulary, or the
bundled demo model), decoding ``--batch`` greedy requests of random prompts; each round times,
interleaved, the same requests (a) without proposals (``RequestSettings.speculative=False``),
(b) with a proposer that is always right at no cost (it replays the tokens of a run without
proposals: every proposal accepted, the upper bound of the verification machinery), (c) with a
proposer that is always wrong (a token the replies never hold: the lower bound; the acceptance
rule shrinks its proposals, then pauses them), and (d) (c) again with the acceptance rule off
(``num_tokens`` proposed at every step: what verifying them costs).  The step-level rule
(``disable_by_batch_size``) is off, so every batch size proposes.  decode tok/s = batch * N /
(time of N + 1 new tokens - time of 1), median [min-max] of ``--reps`` rounds; each cost column is
the step's time with proposals over its time without (from (b): (k+1) x tok/s without / tok/s
with, each step giving k + 1 tokens).

``cost``: the decoding pass alone (the model's forward pass and the logits of every fed
position), with ``k`` proposed tokens a row and without, at each batch size: the fastest of
``--reps`` interleaved repetitions, which a busy machine disturbs least.

``ngram``: the demo model continuing Shakespeare it is given twice (the second copy cut short),
greedy, with n-gram speculation as ``Llama.build`` sets it up (``{"method": "ngram",
"num_tokens": --k}``) against none, interleaved: decode tok/s and the share of proposals accepted.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path

import fire
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CONFIGS, LLAMA3_VOCAB, REPO, llama3_tokenizer, random_weights, set_threads  # noqa: E402
from llama import Llama, ModelArgs  # noqa: E402
from llama.engine import Engine, RequestSettings  # noqa: E402
from llama.engine.speculative import NgramProposer, SpeculativeConfig, Speculator  # noqa: E402

DEMO = REPO / "demo"
QUOTED = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
          "Arise, fair sun, and kill the envious moon,\nWho is already sick and pale with grief,\n"
          "That thou her maid art far more fair than she.\n\n")


class BenchProposer:
    """The proposals of ``mode``: ``replay`` (what ``reference`` holds after the same tokens),
    ``wrong`` (``wrong_token``, again and again) or ``ngram`` (prompt lookup)."""

    def __init__(self) -> None:
        self.mode = "replay"
        self.reference: list[list[int]] = []
        self.wrong_token = 0
        self.ngram = NgramProposer()

    def propose(self, tokens, k):
        if self.mode == "wrong":
            return [self.wrong_token] * k
        if self.mode == "ngram":
            return self.ngram.propose(tokens, k)
        tokens = list(tokens)
        for seq in self.reference:
            if seq[: len(tokens)] == tokens:
                return seq[len(tokens) : len(tokens) + k]
        return []


class Unadapted(Speculator):
    """A speculator that always proposes ``num_tokens`` (its acceptance rule off)."""

    def allowance(self, request) -> int:
        room = request.budget - len(request.generated)
        return max(0, min(self.config.num_tokens, room - 1)) if request.settings.speculative else 0


def build(config: str, dtype: torch.dtype, max_seq_len: int, batch: int, compile: bool) -> Llama:
    if config == "demo":
        return Llama.build(DEMO, DEMO / "tokenizer.model", max_seq_len=max_seq_len, max_batch_size=batch,
                           device="cpu", dtype=dtype, compile=False)
    args = ModelArgs(**CONFIGS[config], vocab_size=LLAMA3_VOCAB, max_seq_len=max_seq_len, max_batch_size=batch)
    model, state = random_weights(args, dtype)
    model.load_state_dict(state, assign=True)
    model.setup_rope()
    return Llama(model, llama3_tokenizer(), compile=False)


def decode_rate(engine: Engine, prompts: list[list[int]], new_tokens: int, speculative: bool) -> float:
    """Decode tok/s of ``prompts`` together: (N + 1 tokens) - (1 token) each."""
    def timed(n: int) -> float:
        start = time.perf_counter()
        handles = [engine.submit(p, RequestSettings(max_new_tokens=n, temperature=0, speculative=speculative,
                                                    stop_tokens=frozenset()))
                   for p in prompts]
        for h in handles:
            h.result()
        return time.perf_counter() - start

    return len(prompts) * new_tokens / (timed(new_tokens + 1) - timed(1))


def sizes_of(batches) -> list[int]:
    """``--batches 1,2,4`` as fire gives it (a tuple, an int or a string)."""
    if isinstance(batches, (tuple, list)):
        return [int(b) for b in batches]
    return [int(b) for b in str(batches).split(",")]


def fmt(values: list[float]) -> str:
    v = sorted(values)
    return f"{statistics.median(v):.1f} [{v[0]:.1f}-{v[-1]:.1f}]"


def rule(config: str = "150m", dtype: str = "float32", threads: int = 2, batches: str = "1,2,4,8", k: int = 4,
         prompt_len: int = 64, new_tokens: int = 40, reps: int = 3, compile: bool = False) -> None:
    logging.basicConfig(level=logging.WARNING)
    set_threads(threads)
    sizes = sizes_of(batches)
    torch_dtype = getattr(torch, dtype)
    max_seq_len = prompt_len + new_tokens + 8
    llama = build(config, torch_dtype, max_seq_len, max(sizes), compile)
    proposer = BenchProposer()
    options = dict(generator=torch.Generator().manual_seed(0), compile=compile)
    spec_config = SpeculativeConfig(num_tokens=k, disable_by_batch_size=1 << 20)
    engine = Engine(llama.model, llama.tokenizer, speculative=spec_config, proposer=proposer, **options)
    unadapted = Engine(llama.model, llama.tokenizer, speculative=spec_config, proposer=proposer, **options)
    unadapted.scheduler.speculator = Unadapted(spec_config, proposer)  # benchmark only: the rule off
    g = torch.Generator().manual_seed(3)
    vocab = min(llama.tokenizer.n_words, llama.model.vocab_size)
    prompts = [[1] + torch.randint(3, vocab, (prompt_len - 1,), generator=g).tolist() for _ in range(max(sizes))]
    # the replies without proposals, which the replaying proposer proposes
    replies = [engine.submit(p, RequestSettings(max_new_tokens=new_tokens + 1, temperature=0, speculative=False,
                                                stop_tokens=frozenset())).result().tokens for p in prompts]
    proposer.reference = [p + r for p, r in zip(prompts, replies)]
    seen = {t for r in replies for t in r}
    proposer.wrong_token = next(t for t in range(3, vocab) if t not in seen)
    columns = ["none", "right", "wrong", "wrong, every step"]
    rates: dict[tuple[int, str], list[float]] = {}
    for _ in range(reps):
        for b in sizes:
            for column in columns:
                proposer.mode = "wrong" if column.startswith("wrong") else "replay"
                target = unadapted if column == "wrong, every step" else engine
                rate = decode_rate(target, prompts[:b], new_tokens, speculative=column != "none")
                rates.setdefault((b, column), []).append(rate)
    print(f"\nspeculative decoding, config {config}, {dtype}, {threads} thread(s), k={k}, prompt {prompt_len}, "
          f"{new_tokens} new tokens, {reps} interleaved rounds (decode tok/s)")
    print("| batch | none | always right | always wrong | wrong, rule off | right: step cost | "
          "wrong, rule off: step cost |")
    print("|---|---|---|---|---|---|---|")
    for b in sizes:
        none = statistics.median(rates[(b, "none")])
        right = statistics.median(rates[(b, "right")])
        every = statistics.median(rates[(b, "wrong, every step")])
        print(f"| {b} | {fmt(rates[(b, 'none')])} | {fmt(rates[(b, 'right')])} | {fmt(rates[(b, 'wrong')])} | "
              f"{fmt(rates[(b, 'wrong, every step')])} | {(k + 1) * none / right:.2f}x | {none / every:.2f}x |")


def cost(config: str = "150m", dtype: str = "float32", threads: int = 1, batches: str = "1,2,4,8", k: int = 4,
         context: int = 128, reps: int = 20) -> None:
    """What a decoding pass costs with ``k`` proposed tokens after each row's next one, against
    the plain pass of the same rows: the model's forward pass over the paged cache and the
    logits of every fed position, as the engine's runner runs them (eager), at ``context``
    positions; the fastest of ``reps`` interleaved repetitions (the least disturbed by other
    processes on a busy machine)."""
    logging.basicConfig(level=logging.WARNING)
    set_threads(threads)
    sizes = sizes_of(batches)
    llama = build(config, getattr(torch, dtype), context + k + 8, max(sizes), compile=False)
    model, kv = llama.model, llama.engine.kv
    vocab = min(llama.tokenizer.n_words, model.vocab_size)
    g = torch.Generator().manual_seed(0)
    best: dict[tuple[int, int], float] = {}
    with torch.inference_mode():
        for b in sizes:
            table = kv.whole_sequences(b, model.device)
            # every row's context, written once
            model.hidden_states(torch.randint(3, vocab, (b, context), generator=g),
                                torch.arange(context).expand(b, context), context, kv.cache, from_start=True,
                                block_table=table)
        for _ in range(reps):
            for b in sizes:
                table = kv.whole_sequences(b, model.device)
                for width in (1, 1 + k):
                    tokens = torch.randint(3, vocab, (b, width), generator=g)
                    positions = (context + torch.arange(width)).expand(b, width)
                    start = time.perf_counter()
                    hidden = model.hidden_states(tokens, positions, context + width, kv.cache, block_table=table)
                    model.logits(hidden.reshape(b * width, -1))
                    seconds = time.perf_counter() - start
                    best[(b, width)] = min(best.get((b, width), float("inf")), seconds)
    print(f"\ndecoding pass with {k} proposed tokens a row against without, config {config}, {dtype}, {threads} "
          f"thread(s), context {context}, fastest of {reps} interleaved (ms)")
    print(f"| rows | plain | with {k} proposals | cost |\n|---|---|---|---|")
    for b in sizes:
        plain, verify = best[(b, 1)], best[(b, 1 + k)]
        print(f"| {b} | {1000 * plain:.2f} | {1000 * verify:.2f} | {verify / plain:.2f}x |")


def ngram(threads: int = 2, batches: str = "1,4", k: int = 4, new_tokens: int = 60, reps: int = 3) -> None:
    logging.basicConfig(level=logging.WARNING)
    set_threads(threads)
    sizes = sizes_of(batches)
    llama = Llama.build(DEMO, DEMO / "tokenizer.model", max_seq_len=256, max_batch_size=max(sizes), device="cpu",
                        dtype="float32", compile=False, speculative={"method": "ngram", "num_tokens": k})
    engine = llama.engine
    lines = QUOTED.splitlines(keepends=True)
    # each prompt: the passage, then its first lines again (each prompt cut elsewhere)
    prompts = [llama.tokenizer.encode(QUOTED + "".join(lines[:1 + i % 3]), bos=True, eos=False)
               for i in range(max(sizes))]
    rates: dict[tuple[int, bool], list[float]] = {}
    accepted: dict[int, list[float]] = {}
    for _ in range(reps):
        for b in sizes:
            for speculative in (False, True):
                before = engine.stats()
                rates.setdefault((b, speculative), []).append(decode_rate(engine, prompts[:b], new_tokens, speculative))
                after = engine.stats()
                if speculative:
                    proposed = after["spec_proposed_tokens_total"] - before["spec_proposed_tokens_total"]
                    got = after["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
                    accepted.setdefault(b, []).append(100 * got / max(1, proposed))
    print(f"\nn-gram speculation, demo model, float32, {threads} thread(s), k={k}, {new_tokens} new tokens, "
          f"{reps} interleaved rounds (decode tok/s)")
    print("| batch | none | ngram | speed-up | proposals accepted (%) |\n|---|---|---|---|---|")
    for b in sizes:
        none, spec = statistics.median(rates[(b, False)]), statistics.median(rates[(b, True)])
        print(f"| {b} | {fmt(rates[(b, False)])} | {fmt(rates[(b, True)])} | {spec / none:.2f}x | "
              f"{statistics.median(accepted[b]):.0f} |")


if __name__ == "__main__":
    fire.Fire({"rule": rule, "cost": cost, "ngram": ngram})
