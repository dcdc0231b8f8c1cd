"""Speculative decoding on the CPU: what verifying proposed tokens costs and saves, by batch size.

    python benchmarks/bench_speculative.py cost --config 150m --dtype float32 --threads 1 --batches 1,2,4,8
    python benchmarks/bench_speculative.py rule --config 150m --dtype float32 --threads 2 --batches 1,2,4,8
    python benchmarks/bench_speculative.py rule --config demo --dtype float32 --threads 2
    python benchmarks/bench_speculative.py ngram --threads 2 --batches 1,4

``rule``: one engine (random weights of ``--config``'s shape with Llama 3's vocabulary, or the
bundled demo model), decoding ``--batches`` greedy requests of random prompts; each round times,
interleaved, the same requests (a) without proposals (``RequestSettings.speculative=False``),
(b) with a proposer that is always right at no cost (it replays the tokens of a run without
proposals: every proposal accepted, the upper bound of the verification machinery), (c) with a
proposer that is always wrong (a token the replies never hold: the lower bound), each under the
engine's rules (:mod:`llama.engine.speculative`: fewer proposals, then none, as they are
rejected; fewer and none as the batch grows), then (b) and (c) again with the rules off (every
row proposes ``k`` tokens at every step).  decode tok/s = batch * N / (time of N + 1 new tokens
- time of 1), median [min-max] of ``--reps`` rounds, and in brackets the median over (a)'s.

``cost``: the decoding pass alone (the model's forward pass and the logits of every fed
position), with ``k`` proposed tokens a row and without, at each batch size: the fastest of
``--reps`` interleaved repetitions, which a busy machine disturbs least.

``ngram``: the demo model continuing Shakespeare's openings (:data:`OPENINGS`, each request its
own, stop tokens off), greedy, with n-gram speculation as ``Llama.build`` sets it up
(``{"method": "ngram", "num_tokens": --k}``) against none, interleaved: decode tok/s and the
share of proposals accepted.

``--clock cpu`` (with ``--threads 1``) times the calling thread's CPU time instead of the wall
clock: on a machine other processes keep busy, wall times swing several-fold from one round to
the next, while the CPU time a step takes barely moves.
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
# Openings the demo model continues greedily: it does not copy a passage it is given (too small
# to have learnt to), but its replies come back to lines they said before, which prompt lookup
# proposes.
OPENINGS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\nROMEO:\n"
    "But soft, what light through yonder window breaks?\nIt is the east,",
    "JULIET:\nO Romeo, Romeo",
    "KING HENRY:\nWhat says the noble Duke of",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
]


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


class Unruled(Speculator):
    """A speculator whose rules are off: every decoding row proposes ``num_tokens`` at every
    step, whatever the batch and whatever was accepted."""

    def proposals(self, decoding):
        out = {}
        for request in decoding:
            k = min(self.config.num_tokens, request.budget - len(request.generated) - 1)
            proposed = self.proposer.propose(request.tokens_so_far(), k)[:k] if k > 0 else []
            if proposed:
                out[request.id] = proposed
        return out


def build(config: str, dtype: torch.dtype, max_seq_len: int, batch: int, compile: bool) -> Llama:
    if config == "demo":
        return Llama.build(DEMO, DEMO / "tokenizer.model", max_seq_len=max_seq_len, max_batch_size=batch,
                           device="cpu", dtype=dtype, compile=False)
    args = ModelArgs(**CONFIGS[config], vocab_size=LLAMA3_VOCAB, max_seq_len=max_seq_len, max_batch_size=batch)
    model, state = random_weights(args, dtype)
    model.load_state_dict(state, assign=True)
    model.setup_rope()
    return Llama(model, llama3_tokenizer(), compile=False)


def clock_of(name: str):
    """``wall``: time.perf_counter; ``cpu``: this thread's CPU time (time.thread_time), which other
    processes on a busy machine barely change: with 1 thread the engine runs every step, and
    torch every product, on the calling thread."""
    if name not in ("wall", "cpu"):
        raise ValueError(f"--clock must be wall or cpu, got {name!r}")
    return time.perf_counter if name == "wall" else time.thread_time


def decode_rate(engine: Engine, prompts: list[list[int]], new_tokens: int, speculative: bool,
                clock=time.perf_counter) -> float:
    """Decode tok/s of ``prompts`` together: (N + 1 tokens) - (1 token) each."""
    def timed(n: int) -> float:
        start = clock()
        handles = [engine.submit(p, RequestSettings(max_new_tokens=n, temperature=0, speculative=speculative,
                                                    stop_tokens=frozenset()))
                   for p in prompts]
        for h in handles:
            h.result()
        return clock() - start

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
         prompt_len: int = 64, new_tokens: int = 40, reps: int = 3, compile: bool = False, clock: str = "wall") -> None:
    logging.basicConfig(level=logging.WARNING)
    set_threads(threads)
    timer = clock_of(clock)
    sizes = sizes_of(batches)
    torch_dtype = getattr(torch, dtype)
    max_seq_len = prompt_len + new_tokens + 8
    llama = build(config, torch_dtype, max_seq_len, max(sizes), compile)
    proposer = BenchProposer()
    options = dict(generator=torch.Generator().manual_seed(0), compile=compile)
    spec_config = SpeculativeConfig(num_tokens=k)
    engine = Engine(llama.model, llama.tokenizer, speculative=spec_config, proposer=proposer, **options)
    unruled = Engine(llama.model, llama.tokenizer, speculative=spec_config, proposer=proposer, **options)
    unruled.scheduler.speculator = Unruled(spec_config, proposer)  # benchmark only: the rules off
    g = torch.Generator().manual_seed(3)
    vocab = min(llama.tokenizer.n_words, llama.model.vocab_size)
    prompts = [[1] + torch.randint(3, vocab, (prompt_len - 1,), generator=g).tolist() for _ in range(max(sizes))]
    # the replies without proposals, which the replaying proposer proposes
    replies = [engine.submit(p, RequestSettings(max_new_tokens=new_tokens + 1, temperature=0, speculative=False,
                                                stop_tokens=frozenset())).result().tokens for p in prompts]
    proposer.reference = [p + r for p, r in zip(prompts, replies)]
    seen = {t for r in replies for t in r}
    proposer.wrong_token = next(t for t in range(3, vocab) if t not in seen)
    columns = ["none", "right", "wrong", "right, rules off", "wrong, rules off"]
    rates: dict[tuple[int, str], list[float]] = {}
    for _ in range(reps):
        for b in sizes:
            for column in columns:
                proposer.mode = "wrong" if column.startswith("wrong") else "replay"
                target = unruled if column.endswith("rules off") else engine
                rate = decode_rate(target, prompts[:b], new_tokens, speculative=column != "none", clock=timer)
                rates.setdefault((b, column), []).append(rate)
    print(f"\nspeculative decoding, config {config}, {dtype}, {threads} thread(s), k={k}, prompt {prompt_len}, "
          f"{new_tokens} new tokens, {reps} interleaved rounds (decode tok/s, {clock} clock; in brackets: / none)")
    print("| batch | " + " | ".join(columns) + " |\n" + "|---" * (len(columns) + 1) + "|")
    for b in sizes:
        none = statistics.median(rates[(b, "none")])
        cells = [fmt(rates[(b, "none")])]
        cells += [f"{fmt(rates[(b, c)])} ({statistics.median(rates[(b, c)]) / none:.2f})" for c in columns[1:]]
        print(f"| {b} | " + " | ".join(cells) + " |")


def cost(config: str = "150m", dtype: str = "float32", threads: int = 1, batches: str = "1,2,4,8", k: int = 4,
         context: int = 128, reps: int = 20, clock: str = "wall") -> None:
    """What a decoding pass costs with ``k`` proposed tokens after each row's next one, against
    the plain pass of the same rows: the model's forward pass over the paged cache and the
    logits of every fed position, as the engine's runner runs them (eager), at ``context``
    positions; the fastest of ``reps`` interleaved repetitions (the least disturbed by other
    processes on a busy machine)."""
    logging.basicConfig(level=logging.WARNING)
    set_threads(threads)
    timer = clock_of(clock)
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
                    start = timer()
                    hidden = model.hidden_states(tokens, positions, context + width, kv.cache, block_table=table)
                    model.logits(hidden.reshape(b * width, -1))
                    seconds = timer() - start
                    best[(b, width)] = min(best.get((b, width), float("inf")), seconds)
    print(f"\ndecoding pass with {k} proposed tokens a row against without, config {config}, {dtype}, {threads} "
          f"thread(s), context {context}, fastest of {reps} interleaved (ms, {clock} clock)")
    print(f"| rows | plain | with {k} proposals | cost |\n|---|---|---|---|")
    for b in sizes:
        plain, verify = best[(b, 1)], best[(b, 1 + k)]
        print(f"| {b} | {1000 * plain:.2f} | {1000 * verify:.2f} | {verify / plain:.2f}x |")


def ngram(threads: int = 2, batches: str = "1,4", k: int = 4, new_tokens: int = 60, reps: int = 3,
          clock: str = "wall") -> None:
    logging.basicConfig(level=logging.WARNING)
    set_threads(threads)
    timer = clock_of(clock)
    sizes = sizes_of(batches)
    llama = Llama.build(DEMO, DEMO / "tokenizer.model", max_seq_len=256, max_batch_size=max(sizes), device="cpu",
                        dtype="float32", compile=False, speculative={"method": "ngram", "num_tokens": k})
    engine = llama.engine
    prompts = [llama.tokenizer.encode(OPENINGS[i % len(OPENINGS)], bos=True, eos=False) for i in range(max(sizes))]
    rates: dict[tuple[int, bool], list[float]] = {}
    accepted: dict[int, list[float]] = {}
    for _ in range(reps):
        for b in sizes:
            for speculative in (False, True):
                before = engine.stats()
                rate = decode_rate(engine, prompts[:b], new_tokens, speculative, clock=timer)
                rates.setdefault((b, speculative), []).append(rate)
                after = engine.stats()
                if speculative:
                    proposed = after["spec_proposed_tokens_total"] - before["spec_proposed_tokens_total"]
                    got = after["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
                    accepted.setdefault(b, []).append(100 * got / max(1, proposed))
    print(f"\nn-gram speculation, demo model, float32, {threads} thread(s), k={k}, {new_tokens} new tokens, "
          f"{reps} interleaved rounds (decode tok/s, {clock} clock)")
    print("| batch | none | ngram | speed-up | proposals accepted (%) |\n|---|---|---|---|---|")
    for b in sizes:
        none, spec = statistics.median(rates[(b, False)]), statistics.median(rates[(b, True)])
        print(f"| {b} | {fmt(rates[(b, False)])} | {fmt(rates[(b, True)])} | {spec / none:.2f}x | "
              f"{statistics.median(accepted[b]):.0f} |")


if __name__ == "__main__":
    fire.Fire({"rule": rule, "cost": cost, "ngram": ngram})
