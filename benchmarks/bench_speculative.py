"""Speculative decoding on the CPU: what verifying proposed tokens costs and saves, by batch size.

    python benchmarks/bench_speculative.py table     # the issue's table (defaults: about 25 min, see below)
    python benchmarks/bench_speculative.py table --configs 150m --threads 1 --batches 1 --rows b,c
    python benchmarks/bench_speculative.py cost --config 150m --dtype float32 --threads 1 --batches 1,2,4,8
    python benchmarks/bench_speculative.py rule --config 150m --dtype float32 --threads 2 --batches 1,2,4,8
    python benchmarks/bench_speculative.py rule --config demo --dtype float32 --threads 2
    python benchmarks/bench_speculative.py ngram --threads 2 --batches 1,4
    python benchmarks/bench_speculative.py train_draft   # the (d) row's draft alone (trained on first use)

``table``: the issue's table, each (config, thread count) in a fresh process (Inductor compiles
its CPU kernels for the thread count it sees), ``--dtype`` bfloat16, the engine's defaults
(compiled where ``Llama.build`` compiles: bfloat16 on a CPU with a C++ compiler; the steps that
verify proposals compiled with the decoding step, at start), ``--k`` 4 proposed tokens.  In
each process, after the engine is built, each round times, for each batch size, the batch's
greedy requests without speculation (``RequestSettings.speculative=False``), then with each
row's proposer, one after the other (interleaved: a round is none, a, b, c, d), under the
engine's rules (:mod:`llama.engine.speculative`; at 8 rows they propose nothing), each row with a
speculator of its own (what the rule measures of one proposer, its steps' costs and the
acceptance new requests start from, is not carried to the next):

- (a) prompt lookup (the engine's own n-gram proposer, ``{"method": "ngram"}``) on ``demo``
  (the bundled Shakespeare model, the trained pair's target) continuing Shakespeare's openings
  (:data:`OPENINGS`; one repeats its first lines, and the model's replies come back to lines
  they said before).  Not on the random-weight shapes by default: random weights neither quote
  their prompt nor, within these replies, repeat themselves (150m's 64-token replies to
  random, repeating and constant prompts had prompt lookup propose 3 to 27 tokens in all), so
  there it would measure only the cost of looking (``--rows a`` runs it anyway);
- (b) always right at no cost: a proposer replaying the greedy tokens of earlier runs of the
  same requests (:func:`settle_replay`: in bfloat16 a verifying pass rounds differently from a
  one-token pass, so a run with speculation may leave the reply without it at a near tie; the
  replies such runs give are replayed too, until a run gives no new one);
- (c) always wrong: a token none of the replies holds;
- (d) a trained pair: the demo model as the target and a smaller draft trained on the same
  text with ``tools/train_demo.py`` and the demo's tokenizer (:data:`DRAFT_RECIPE`, trained on
  first use into ``--draft_dir``, seeded; the training time is printed); ``demo`` only.

Rows by default: (b) and (c) on 150m and 1b (:data:`common.CONFIGS`: random weights, Llama 3's
vocabulary), all four on demo.  Prompts: random, ``--prompt_len`` tokens (150m, 1b); the
openings (demo).  Columns: decode tok/s
without and with speculation, median [min-max] over ``--reps`` rounds, decode tok/s = batch * N
/ (time of N + 1 new tokens - time of 1); ratio: the median over the rounds of each round's
speculating over none; acceptance: the share of proposed tokens accepted (all rounds).
Default settings (:data:`TABLE_DEFAULTS`): 150m 48 new tokens, 3 rounds, batches 1 and 8; 1b
16 new tokens, 2 rounds, batch 1 only (1B in bfloat16 decodes at a few tok/s on 2 cores, and an
engine of one row compiles one decoding graph instead of four; its steps of 8 rows, where the
rules propose nothing, are measured on 150m and demo: ``--configs 1b --batches 1,8`` adds them);
demo 64 new tokens, 3 rounds, batches 1 and 8.  Estimated from the CPU times of shorter runs on a
loaded machine: about 23 minutes on 2 quiet Cascade Lake cores with an empty Inductor cache
(compiling is most of it: about 3 minutes per process for 150m, a little less for 1b at one row
and for demo), and the draft's training on first use, about 4 to 5 minutes more (printed; 14
minutes of wall and 7.6 of CPU time on the loaded machine).
``--configs``, ``--threads``, ``--batches``, ``--rows``, ``--reps``, ``--new_tokens`` cut it down.
``--out FILE`` also writes every measurement as JSON.

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

import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import fire
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CONFIGS, LLAMA3_VOCAB, REPO, llama3_tokenizer, random_weights, rate_past_first_token, set_threads  # noqa: E402
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
    "HAMLET:\nTo be, or not to be, that is the question:\n",
    "MACBETH:\nTomorrow, and tomorrow, and tomorrow,\n",
    "PORTIA:\nThe quality of mercy is not strain'd,\n",
    "DUKE ORSINO:\nIf music be the food of love, play on;\n",
]

# The (d) row's draft: trained by tools/train_demo.py on the demo's text with the demo's
# tokenizer (--tokenizer_from demo), half its width and a third of its depth, on 1M tokens (the
# demo saw 4M), in float32 (bfloat16 autocast took twice as long a step on a CPU without bfloat16
# arithmetic, Cascade Lake).
DRAFT_RECIPE: dict[str, Any] = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=128, seq_len=256,
                                    batch_size=8, steps=500, lr=3e-3, warmup=50, seed=1234, eval_every=500,
                                    eval_chunks=16, log_every=100, autocast=False)
DEFAULT_DRAFT_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-bench" / "demo-draft"
DRAFT_FILES = ("params.json", "consolidated.00.pth", "tokenizer.model")

# The table's rows, and the settings of each configuration unless flags give others.  (p) and
# (e) are for random weights, where no proposer is right by itself (benchmarks/gpu_check.py's
# speculative part): each proposal right with a set probability (:data:`PARTLY_RIGHT`), and a
# draft model's forwards (its cost) with such proposals in place of its own (:data:`DRAFT_RIGHT`).
ROWS = {"a": "n-gram", "b": "always right", "c": "always wrong", "d": "draft", "p": "partly right",
        "e": "draft's cost, partly right"}
# (p): each proposal right with this probability, independently (the geometric law the rule
# assumes, :class:`~llama.engine.speculative.Acceptance`): of 4 proposed, 0.7 + 0.7**2 + 0.7**3 +
# 0.7**4 = 1.77 accepted on average (44 %), the demo's n-gram acceptance (43-45 %, BENCHMARKS.md);
# the rule proposing fewer, more of them are.
PARTLY_RIGHT = 0.7
# (e): 0.88, so that 4 proposals are 73 % accepted on average, llama.cpp's Llama 3.2 1B drafting
# Llama 3.1 8B (72 %, issue 41).
DRAFT_RIGHT = 0.88
# (a) and (d) need trained weights: random ones neither quote their prompt nor, within these
# replies, repeat themselves (150m's 64-token replies to random prompts proposed 3 tokens in all).
# 1b at batch 1 only by default: its compilation and its 8-row steps (where the rules propose
# nothing: what 8 rows cost is measured on 150m and demo) would take the table past 25 minutes.
TABLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "150m": dict(rows="b,c", batches="1,8", prompt_len=32, new_tokens=48, reps=3),
    "1b": dict(rows="b,c", batches="1", prompt_len=32, new_tokens=16, reps=2),
    "demo": dict(rows="a,b,c,d", batches="1,8", prompt_len=0, new_tokens=64, reps=3),  # prompts: OPENINGS
}


class BenchProposer:
    """The proposals of ``mode``: ``replay`` (what ``reference`` holds after the same tokens;
    with ``right`` below 1, each replayed token kept with that probability and otherwise
    ``wrong_token``, seeded), ``wrong`` (``wrong_token``, again and again) or ``ngram`` (prompt
    lookup)."""

    def __init__(self, seed: int = 0) -> None:
        self.mode = "replay"
        self.reference: list[list[int]] = []
        self.wrong_token = 0
        self.right = 1.0
        self.random = random.Random(seed)
        self.ngram = NgramProposer()

    def propose(self, tokens, k):
        if self.mode == "wrong":
            return [self.wrong_token] * k
        if self.mode == "ngram":
            return self.ngram.propose(tokens, k)
        tokens = list(tokens)
        for seq in self.reference:
            if seq[: len(tokens)] == tokens:
                replayed = seq[len(tokens) : len(tokens) + k]
                if self.right < 1:
                    replayed = [t if self.random.random() < self.right else self.wrong_token for t in replayed]
                return replayed
        return []


class DraftReplay:
    """A draft model's proposing (``draft``, a :class:`~llama.engine.speculative.RowProposer`:
    its catch-up and decoding passes, its cache), with ``replay``'s proposals (as many) in place
    of the draft's own: what a draft of this size costs, at the acceptance ``replay`` gives
    (random weights: a random draft is never right)."""

    def __init__(self, draft, replay: BenchProposer) -> None:
        self.draft, self.replay = draft, replay

    def propose_rows(self, rows):
        proposed, _ = self.draft.propose_rows(rows)
        out = {}
        for request, _k in rows:
            if proposed.get(request.id):
                out[request.id] = self.replay.propose(request.tokens_so_far(), len(proposed[request.id]))
        return out, {}  # greedy requests only: no draft distributions

    def release(self, request_id: int) -> None:
        self.draft.release(request_id)


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
    """Decode tok/s of ``prompts`` together: (N + 1 tokens) - (1 token) each (common.rate_past_first_token)."""
    def timed(n: int) -> float:
        start = clock()
        handles = [engine.submit(p, RequestSettings(max_new_tokens=n, temperature=0, speculative=speculative,
                                                    stop_tokens=frozenset()))
                   for p in prompts]
        for h in handles:
            h.result()
        return clock() - start

    return rate_past_first_token(timed, new_tokens, len(prompts))


def sizes_of(batches) -> list[int]:
    """``--batches 1,2,4`` as fire gives it (a tuple, an int or a string)."""
    if isinstance(batches, (tuple, list)):
        return [int(b) for b in batches]
    return [int(b) for b in str(batches).split(",")]


def names_of(value) -> list[str]:
    """``--rows a,b`` or ``--configs 150m,1b`` as fire gives it (a tuple or a string)."""
    if isinstance(value, (tuple, list)):
        return [str(v) for v in value]
    return [v for v in str(value).split(",") if v]


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


# -- the table -------------------------------------------------------------------------


def train_draft(draft_dir: Optional[str] = None, threads: int = 2, **overrides: Any) -> Path:
    """The (d) row's draft model in ``draft_dir`` (default :data:`DEFAULT_DRAFT_DIR`), trained
    there by ``tools/train_demo.py`` (:data:`DRAFT_RECIPE`, ``overrides`` changing it; the
    demo's tokenizer; seeded) unless the folder already holds one of that recipe.  Prints the
    training time.  Returns the folder."""
    folder = Path(draft_dir) if draft_dir is not None else DEFAULT_DRAFT_DIR
    recipe = {**DRAFT_RECIPE, **overrides, "threads": threads}
    stamp = folder / "recipe.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe and all((folder / f).is_file() for f in DRAFT_FILES):
        print(f"draft: {folder} (trained before, {recipe})", flush=True)
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    command = [sys.executable, str(REPO / "tools" / "train_demo.py"), "--out_dir", str(folder),
               "--tokenizer_from", str(DEMO)] + [f"--{key}={value}" for key, value in recipe.items()]
    print(f"draft: training {folder} ({recipe}) ...", flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, env=thread_env(threads), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"training the draft failed (exit {done.returncode}): {' '.join(command)}\n"
                           f"{done.stderr[-3000:]}")
    stamp.write_text(json.dumps(recipe))
    print(f"draft: trained in {time.perf_counter() - start:.0f} s", flush=True)
    return folder


def thread_env(threads: int) -> dict[str, str]:
    """This process's environment for a child that runs torch on ``threads`` threads."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def generate(engine: Engine, prompts: Sequence[list[int]], n: int, speculative: bool) -> list[list[int]]:
    """The greedy replies of ``n`` tokens to ``prompts``, submitted together (stop tokens off)."""
    handles = [engine.submit(list(p), RequestSettings(max_new_tokens=n, temperature=0, speculative=speculative,
                                                      stop_tokens=frozenset()))
               for p in prompts]
    return [h.result().tokens for h in handles]


def settle_replay(engine: Engine, proposer: BenchProposer, prompts: Sequence[list[int]], n: int,
                  most: int = 6) -> tuple[list[list[int]], int]:
    """(the sequences, prompt and reply, that the replaying proposer replays for ``prompts``, the
    runs it took): the replies a run with speculation gives while its proposals are replayed
    from them, so that (nearly) every proposal is right.  In float32 the first run without
    speculation gives them.  In bfloat16 a verifying pass rounds differently from a one-token
    pass, and a reply may leave the one it replays where two tokens are nearly tied (where
    also the blocks a request's keys and values happen to be in change the rounding); each
    such reply is kept too, and the proposer replays whichever sequence the tokens so far
    begin with, until a run gives only replies it holds (at most ``most`` runs).  The
    engine's proposer must be ``proposer`` (its mode is set here)."""
    proposer.mode = "replay"
    replies = generate(engine, prompts, n, speculative=False)
    sequences = [list(p) + r for p, r in zip(prompts, replies)]
    for run in range(1, most + 1):
        proposer.reference = sequences
        got = [list(p) + r for p, r in zip(prompts, generate(engine, prompts, n, speculative=True))]
        new = [seq for seq in got if seq not in sequences]
        if not new:
            return sequences, run
        sequences = new + sequences  # the latest first: replayed before an older reply
    logging.getLogger(__name__).warning("the replayed replies did not settle in %d runs: (b) is not always right", most)
    return sequences, most


def measure(engine: Engine, prompts: Sequence[list[int]], rows: Sequence[str], sizes: Sequence[int],
            new_tokens: int, reps: int, *, ngram: Optional[Any] = None, draft: Optional[Any] = None,
            right: float = PARTLY_RIGHT, draft_right: float = DRAFT_RIGHT,
            stop: Optional[Callable[[], bool]] = None, label: str = "") -> dict:
    """The table's ``rows`` (:data:`ROWS`) for ``prompts[:b]`` at each ``b`` of ``sizes``, on
    ``engine`` (built speculating: its rules and its verification step), interleaved: each round
    times, for each batch size, the greedy requests without speculation, then with each row's
    proposer, each row with a speculator of its own (what the rule learns of a proposer, its
    steps' costs and the acceptance new requests start from, is not carried to the next).
    ``ngram``: (a)'s proposer (default a new prompt lookup); ``draft``: the engine's draft model
    (a RowProposer), which (d) and (e) need; ``right`` and ``draft_right``: (p)'s and (e)'s
    probability that a proposal is right; ``stop``: asked before each round, True ends the
    measuring (the rounds so far kept).  Returns ``{"settle_runs", "prepared_s", "measured_s",
    "rounds", "batches": {b: {"none": [tok/s by round], row: {"rates", "proposed", "accepted"}}}}``;
    the engine's speculator is as it was."""
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise ValueError(f"rows: unknown row(s) {unknown}; the rows are {list(ROWS)}")
    if draft is None and ({"d", "e"} & set(rows)):
        raise ValueError("rows d and e need the engine's draft model: build it with {'method': 'draft', ...}")
    speculator = engine.speculator
    if speculator is None:
        raise ValueError("the engine does not speculate: build it with speculative={...}")
    own = speculator.proposer
    bench = BenchProposer()

    # (b)'s replayed replies and (c)'s wrong token, for each batch size (the rows a step holds
    # change how it rounds)
    start = time.perf_counter()
    cpu = time.process_time()
    speculator.proposer = bench
    references: dict[int, list[list[int]]] = {}
    settle_runs: dict[int, int] = {}
    seen: set[int] = set()
    for b in sizes:
        if b > speculator.config.disable_by_batch_size:  # such steps propose nothing: the replies without
            replies = generate(engine, prompts[:b], new_tokens + 1, speculative=False)
            references[b], settle_runs[b] = [list(p) + r for p, r in zip(prompts[:b], replies)], 0
        else:
            references[b], settle_runs[b] = settle_replay(engine, bench, prompts[:b], new_tokens + 1)
        seen |= {t for seq in references[b] for t in seq}
    bench.wrong_token = next(t for t in range(3, engine.n_decodable) if t not in seen)
    prepared_s = time.perf_counter() - start
    print(f"{label}: replays settled in {prepared_s:.0f} s ({time.process_time() - cpu:.0f} s of CPU time; runs by "
          f"batch: {settle_runs})", file=sys.stderr, flush=True)
    cpu = time.process_time()

    proposers = {"a": ngram if ngram is not None else NgramProposer(), "b": bench, "c": bench, "p": bench,
                 "d": draft, "e": DraftReplay(draft, bench)}
    speculators = {row: Speculator(speculator.config, proposers[row]) for row in rows}

    def use(row: str, b: int) -> None:
        engine.speculator = engine.scheduler.speculator = speculators[row]
        bench.mode = "wrong" if row == "c" else "replay"
        bench.right = {"p": right, "e": draft_right}.get(row, 1.0)
        bench.reference = references[b]

    results: dict[int, Any] = {b: {"none": [], **{row: {"rates": [], "proposed": 0, "accepted": 0} for row in rows}}
                               for b in sizes}
    start = time.perf_counter()
    rounds = 0
    try:
        for _ in range(reps):
            if stop is not None and stop():
                break
            for b in sizes:
                results[b]["none"].append(decode_rate(engine, prompts[:b], new_tokens, speculative=False))
                for row in rows:
                    use(row, b)
                    before = engine.stats()
                    results[b][row]["rates"].append(decode_rate(engine, prompts[:b], new_tokens, speculative=True))
                    after = engine.stats()
                    for key in ("proposed", "accepted"):
                        results[b][row][key] += after[f"spec_{key}_tokens_total"] - before[f"spec_{key}_tokens_total"]
            rounds += 1
    finally:
        engine.speculator = engine.scheduler.speculator = speculator
        speculator.proposer = own
    measured_s = time.perf_counter() - start
    print(f"{label}: measured in {measured_s:.0f} s ({time.process_time() - cpu:.0f} s of CPU time)",
          file=sys.stderr, flush=True)
    return {"settle_runs": settle_runs, "prepared_s": prepared_s, "measured_s": measured_s, "rounds": rounds,
            "batches": results}


def cell(config: str = "150m", threads: int = 1, batches: str = "1,8", rows: str = "a,b,c", k: int = 4,
         prompt_len: int = 32, new_tokens: int = 48, reps: int = 3, dtype: str = "bfloat16",
         draft_dir: Optional[str] = None, out: Optional[str] = None) -> dict:
    """One (config, thread count) of the table, in this process: builds the engine (the
    engine's defaults, speculation as ``Llama.build`` sets it up, compiled where it compiles by
    default) and measures ``rows`` at each of ``batches``, interleaved (see the module's
    docstring); the measurements as a dict (written as JSON to ``out`` too)."""
    logging.basicConfig(level=logging.WARNING)
    set_threads(threads)
    sizes = sizes_of(batches)
    wanted = names_of(rows)
    unknown = sorted(set(wanted) - set(ROWS))
    if unknown:
        raise ValueError(f"--rows: unknown row(s) {unknown}; the rows are {list(ROWS)}")
    if config != "demo":  # a trained pair exists for the demo model only
        wanted = [row for row in wanted if row not in ("d", "e")]
    drafted = bool({"d", "e"} & set(wanted))
    start = time.perf_counter()
    speculative: dict[str, Any] = {"method": "ngram", "num_tokens": k}
    if config == "demo":
        if drafted:
            speculative = {"method": "draft", "draft_ckpt_dir": str(draft_dir or DEFAULT_DRAFT_DIR), "num_tokens": k}
        llama = Llama.build(DEMO, DEMO / "tokenizer.model", max_seq_len=256, max_batch_size=max(sizes), device="cpu",
                            dtype=dtype, speculative=speculative)
        prompts = [llama.tokenizer.encode(OPENINGS[i % len(OPENINGS)], bos=True, eos=False) for i in range(max(sizes))]
    else:
        max_seq_len = prompt_len + new_tokens + k + 8
        args = ModelArgs(**CONFIGS[config], vocab_size=LLAMA3_VOCAB, max_seq_len=max_seq_len,
                         max_batch_size=max(sizes))
        model, state = random_weights(args, getattr(torch, dtype))
        model.load_state_dict(state, assign=True)
        del state
        model.setup_rope()
        llama = Llama(model, llama3_tokenizer(), speculative=speculative)  # compile: the engine's default
        g = torch.Generator().manual_seed(3)
        vocab = min(llama.tokenizer.n_words, llama.model.vocab_size)
        prompts = [[llama.tokenizer.bos_id] + torch.randint(3, vocab, (prompt_len - 1,), generator=g).tolist()
                   for _ in range(max(sizes))]
    engine = llama.engine
    speculator = engine.speculator
    assert speculator is not None
    built_s = time.perf_counter() - start
    cpu = time.process_time()
    print(f"{config}, {threads} thread(s): engine built in {built_s:.0f} s ({cpu:.0f} s of CPU time so far; compiled: "
          f"{engine.runner.compiled})", file=sys.stderr, flush=True)
    own = speculator.proposer  # the engine's n-gram proposer, or its draft
    measured = measure(engine, prompts, wanted, sizes, new_tokens, reps, ngram=NgramProposer() if drafted else own,
                       draft=own if drafted else None, label=f"{config}, {threads} thread(s)")
    settle_runs, prepared_s, measured_s = measured["settle_runs"], measured["prepared_s"], measured["measured_s"]
    results = measured["batches"]
    summary = {"config": config, "threads": threads, "dtype": dtype, "k": k, "compiled": engine.runner.compiled,
               "new_tokens": new_tokens, "reps": reps, "prompt_lens": sorted({len(p) for p in prompts}),
               "rows": wanted, "settle_runs": settle_runs, "built_s": built_s, "prepared_s": prepared_s,
               "measured_s": measured_s, "batches": {str(b): results[b] for b in sizes}}
    if out is not None:
        Path(out).write_text(json.dumps(summary))
    return summary


def table_lines(cells: Sequence[dict]) -> list[str]:
    """The table's markdown lines for measured ``cells`` (what :func:`cell` returns)."""
    lines = ["| config | threads | batch | row | tok/s none | tok/s speculating | ratio | acceptance |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        for b, measured in c["batches"].items():
            none = measured["none"]
            for row in c["rows"]:
                spec = measured[row]
                ratios = [s / n for s, n in zip(spec["rates"], none)]
                accepted = f"{100 * spec['accepted'] / spec['proposed']:.0f} %" if spec["proposed"] else "none proposed"
                lines.append(f"| {c['config']} | {c['threads']} | {b} | ({row}) {ROWS[row]} | {fmt(none)} | "
                             f"{fmt(spec['rates'])} | {statistics.median(ratios):.2f}x | {accepted} |")
    return lines


def table(configs: str = "150m,1b,demo", threads: str = "1,2", batches: Optional[str] = None,
          rows: Optional[str] = None, k: int = 4, reps: Optional[int] = None, new_tokens: Optional[int] = None,
          prompt_len: Optional[int] = None, dtype: str = "bfloat16", draft_dir: Optional[str] = None,
          out: Optional[str] = None) -> None:
    """The issue's table (see the module's docstring): each (config, thread count) measured by
    :func:`cell` in a process of its own; ``batches``, ``rows``, ``reps``, ``new_tokens``,
    ``prompt_len``: for every config (default: :data:`TABLE_DEFAULTS`; (d) is the demo's alone)."""
    started = time.perf_counter()
    names = names_of(configs)
    for name in names:
        if name not in TABLE_DEFAULTS:
            raise ValueError(f"--configs: unknown config {name!r}; the table's are {list(TABLE_DEFAULTS)}")
    thread_counts = sizes_of(threads)
    if batches is not None:
        sizes_of(batches)  # checked before anything runs
    if "demo" in names and "d" in names_of(rows if rows is not None else TABLE_DEFAULTS["demo"]["rows"]):
        draft_dir = str(train_draft(draft_dir, threads=max(thread_counts)))
    cells = []
    for name in names:
        settings = {**TABLE_DEFAULTS[name]}
        for key, value in (("rows", rows), ("batches", batches), ("reps", reps), ("new_tokens", new_tokens),
                           ("prompt_len", prompt_len)):
            if value is not None:
                settings[key] = value
        settings["rows"] = ",".join(names_of(settings["rows"]))
        settings["batches"] = ",".join(map(str, sizes_of(settings["batches"])))
        for t in thread_counts:
            with tempfile.TemporaryDirectory() as tmp:
                result = Path(tmp) / "cell.json"
                command = [sys.executable, str(Path(__file__).resolve()), "cell", f"--config={name}", f"--threads={t}",
                           f"--k={k}", f"--dtype={dtype}", f"--out={result}"]
                command += [f"--{key}={value}" for key, value in settings.items()]
                if draft_dir is not None:
                    command.append(f"--draft_dir={draft_dir}")
                start = time.perf_counter()
                done = subprocess.run(command, env=thread_env(t))
                if done.returncode != 0:
                    raise RuntimeError(f"the cell {name}, {t} thread(s) failed (exit {done.returncode}): "
                                       f"{' '.join(command)}")
                measured = json.loads(result.read_text())
            cells.append(measured)
            print(f"\n{name}, {t} thread(s): {time.perf_counter() - start:.0f} s (engine built in "
                  f"{measured['built_s']:.0f} s, compiled: {measured['compiled']}; replays settled in "
                  f"{measured['settle_runs']} run(s) by batch; measured in {measured['measured_s']:.0f} s)")
            print("\n".join(table_lines([measured])), flush=True)
    print(f"\nspeculative decoding, CPU, {dtype}, k={k} proposed tokens, the engine's default rules; "
          f"{time.perf_counter() - started:.0f} s in all. Per config: "
          + "; ".join(f"{c['config']}: {c['new_tokens']} new tokens, prompts of {c['prompt_lens']} tokens, "
                      f"{c['reps']} rounds" for c in cells[:: max(1, len(thread_counts))]))
    print("\n".join(table_lines(cells)))
    if out is not None:
        Path(out).write_text(json.dumps(cells, indent=1))


if __name__ == "__main__":
    fire.Fire({"table": table, "cell": cell, "train_draft": train_draft, "rule": rule, "cost": cost,
               "ngram": ngram})
