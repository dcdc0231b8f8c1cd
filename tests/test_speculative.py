"""Speculative decoding (llama.engine.speculative): prompt lookup proposes, the engine verifies the
proposals inside its decoding steps, and what comes out is what comes out without them.

References: a second engine of the same checkpoint with speculation off (greedy tokens,
log-probabilities, stop strings and tokens, lengths, seeded samples); a brute-force prompt
lookup written here; the exact distribution of 3-token sequences over a 3-token vocabulary,
against which the acceptance rule's samples are tested (chi-square), a wrong rule failing the
same test; the pool's own consistency check after every step of random traffic; one process
against two under torchrun.  The demo model (Shakespeare, float32 here) repeats itself enough
for prompt lookup to be right often; the tiny random checkpoints loop on their own output.
The compiled verification step (compile=True) is tested in tests/test_compiled.py."""

from __future__ import annotations

import itertools
import math
import random
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import helpers
from llama import Llama
from llama.engine import Engine, RequestSettings, TokenEvent
from llama.engine.sampler import Sampler
from llama.engine.sampling import SamplingParams, nucleus, sampling_distribution
from llama.engine.speculative import (
    MAX_PAUSE_TOKENS,
    MIN_TIMED,
    PAUSE_TOKENS,
    REMEASURE_STEPS,
    Acceptance,
    NgramProposer,
    SpeculativeConfig,
    Speculator,
    check_speculative,
)

DEMO = helpers.REPO / "demo"
NGRAM = {"method": "ngram", "num_tokens": 4}
# Shakespeare the demo model continues by quoting it (prompt lookup's case), and a prompt it does not.
QUOTING = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
           "Arise, fair sun, and kill the envious moon,\nWho is already sick and pale with grief.\n\n"
           "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east,")
PLAIN = "KING HENRY:\nWhat says the noble Duke of"
LOOP = "ROMEO:\n" + "And all the world's eyes are in the world,\n" * 4  # sampled replies quote it now and then


# -- prompt lookup ---------------------------------------------------------------------------


def lookup_reference(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup written plainly: the longest suffix n-gram that occurred earlier, its most
    recent occurrence, what followed it."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):  # the occurrence ends at `end` < length - 1
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 6), st.integers(1, 4), st.integers(0, 3))
def test_prompt_lookup_proposes_what_followed_the_longest_most_recent_match(tokens, k, min_n, extra):
    max_n = min_n + extra
    assert NgramProposer(max_n, min_n).propose(tokens, k) == lookup_reference(tokens, k, max_n, min_n)


def test_prompt_lookup_examples():
    propose = NgramProposer(3, 1).propose
    # "5 6 7" occurred twice: the most recent occurrence's continuation
    assert propose([5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 9, 5, 6, 7], 3) == [3, 4, 9]
    # the 3-gram "2 5 6" beats the more recent 1-gram "6"
    assert propose([2, 5, 6, 8, 8, 6, 0, 2, 5, 6], 2) == [8, 8]
    assert propose([1, 2, 3, 4], 4) == []  # no earlier occurrence of 4
    assert propose([1, 2, 1], 4) == [2, 1]  # what follows may run to the end
    assert NgramProposer(3, 2).propose([7, 1, 9, 1], 4) == []  # "9 1" never occurred before; 1-grams are off


# -- options -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value, error, words", [
    ({"method": "medusa"}, ValueError, "method must be one of ['ngram', 'draft']"),
    ({"num_tokens": 4}, ValueError, "method must be one of"),
    ({"method": "ngram", "num_tokens": 0}, ValueError, "num_tokens must be in [1, 16]"),
    ({"method": "ngram", "num_tokens": 17}, ValueError, "num_tokens must be in [1, 16]"),
    ({"method": "ngram", "num_tokens": 2.0}, TypeError, "num_tokens must be an int"),
    ({"method": "ngram", "k": 4}, ValueError, "unknown option(s) ['k']; the options are ['method', 'num_tokens'"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, ValueError, "must not exceed"),
    ({"method": "ngram", "disable_by_batch_size": 0}, ValueError, "disable_by_batch_size must be >= 1"),
    ({"method": "draft"}, ValueError, "method 'draft' needs draft_ckpt_dir"),
    ({"method": "ngram", "draft_ckpt_dir": "x"}, ValueError, "draft_ckpt_dir goes with method 'draft'"),
    ({"method": "draft", "draft_ckpt_dir": 3}, TypeError, "draft_ckpt_dir must be a path"),
    ({"method": "ngram", "draft_tensor_parallel_size": 1}, ValueError, "draft_tensor_parallel_size goes with"),
    ({"method": "draft", "draft_ckpt_dir": "x", "draft_tensor_parallel_size": 0}, ValueError, "must be >= 1"),
    ({"method": "ngram", "adaptive": 1}, TypeError, "adaptive must be True or False"),
    ("ngram", TypeError, "a dict such as"),
])
def test_speculative_options_are_checked(value, error, words):
    with pytest.raises(error) as e:
        check_speculative(value)
    assert words in str(e.value)


def test_speculative_options_are_read():
    assert check_speculative(None) is None
    assert check_speculative({"method": "ngram"}) == SpeculativeConfig("ngram", 4, 3, 1)
    assert check_speculative({"method": "ngram", "num_tokens": 2, "prompt_lookup_max": 5,
                              "disable_by_batch_size": 64}) == SpeculativeConfig("ngram", 2, 5, 1, 64)
    assert check_speculative({"method": "ngram", "adaptive": False}) == SpeculativeConfig(adaptive=False)


def test_llama_build_refuses_bad_options_before_loading(tmp_path):
    with pytest.raises(ValueError, match="method must be one of"):
        Llama.build(tmp_path / "nothing here", max_seq_len=64, max_batch_size=1, speculative={"method": "eagle"})
    with pytest.raises(ValueError, match="needs draft_ckpt_dir"):
        Llama.build(tmp_path / "nothing here", max_seq_len=64, max_batch_size=1, speculative={"method": "draft"})
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        Llama.build(DEMO, max_seq_len=64, max_batch_size=1,
                    speculative={"method": "draft", "draft_ckpt_dir": tmp_path / "no draft here"})


@pytest.mark.parametrize("argv, words", [
    (["--speculative", "draft"], "--speculative draft needs --draft_ckpt_dir"),
    (["--speculative", "ngram", "--draft_ckpt_dir", "d"], "--draft_ckpt_dir goes with --speculative draft"),
    (["--num_speculative_tokens", "3"], "--num_speculative_tokens goes with --speculative"),
    (["--draft_ckpt_dir", "d"], "--draft_ckpt_dir goes with --speculative: add --speculative draft"),
    (["--draft_tensor_parallel_size", "2"],
     "--draft_tensor_parallel_size goes with --speculative: add --speculative draft"),
    (["--speculative", "ngram", "--draft_tensor_parallel_size", "1"],
     "--draft_tensor_parallel_size goes with --speculative draft, not --speculative ngram"),
])
def test_server_speculative_flags_are_checked(argv, words):
    from llama.serve.server import _parser, speculative_options

    with pytest.raises(ValueError) as e:
        speculative_options(_parser().parse_args(argv))
    assert words in str(e.value)


def test_server_speculative_flags_are_read():
    from llama.serve.server import _parser, speculative_options

    assert speculative_options(_parser().parse_args([])) is None
    assert speculative_options(_parser().parse_args(["--speculative", "ngram"])) == {"method": "ngram"}
    assert speculative_options(_parser().parse_args(["--speculative", "ngram", "--num_speculative_tokens", "6"])) \
        == {"method": "ngram", "num_tokens": 6}
    assert speculative_options(_parser().parse_args(["--speculative", "draft", "--draft_ckpt_dir", str(DEMO)])) \
        == {"method": "draft", "draft_ckpt_dir": str(DEMO)}
    # the Python API's key, under the same name
    drafted = speculative_options(_parser().parse_args(["--speculative", "draft", "--draft_ckpt_dir", str(DEMO),
                                                        "--draft-tensor-parallel-size", "2"]))
    assert drafted == {"method": "draft", "draft_ckpt_dir": str(DEMO), "draft_tensor_parallel_size": 2}
    assert check_speculative(drafted).draft_tensor_parallel_size == 2
    with pytest.raises(SystemExit):  # a count of ranks
        _parser().parse_args(["--speculative", "draft", "--draft_ckpt_dir", str(DEMO),
                              "--draft_tensor_parallel_size", "0"])
    with pytest.raises(FileNotFoundError, match="check --draft_ckpt_dir"):
        speculative_options(_parser().parse_args(["--speculative", "draft", "--draft_ckpt_dir", str(DEMO / "no")]))
    with pytest.raises(SystemExit):
        _parser().parse_args(["--speculative", "medusa"])


def test_metrics_report_proposed_and_accepted_tokens():
    from llama.serve.metrics import ServerMetrics

    class Stats:
        max_batch_size = 2

        def stats(self):
            return dict(queued=0, slots_in_use=0, spec_proposed_tokens_total=12, spec_accepted_tokens_total=7)

    text = ServerMetrics(Stats()).render()[0].decode()
    assert "llama_speculative_proposed_tokens_total 12.0" in text
    assert "llama_speculative_accepted_tokens_total 7.0" in text


def test_the_request_field_turns_it_off():
    from llama.serve.openai_api import CompletionRequest

    assert CompletionRequest(prompt="x").speculative is True
    assert CompletionRequest(prompt="x", speculative=False).speculative is False
    with pytest.raises(TypeError, match="speculative must be True or False"):
        RequestSettings(max_new_tokens=1, speculative=1).checked()


# -- how many tokens a request proposes ------------------------------------------------------


class Decoding:
    """What the speculator reads of a running request."""

    def __init__(self, generated: int = 10, budget: int = 100, speculative: bool = True) -> None:
        self.id = 0
        self.generated = [7] * generated
        self.budget = budget
        self.settings = RequestSettings(max_new_tokens=budget, speculative=speculative)
        self.speculation = Acceptance()

    def tokens_so_far(self) -> list[int]:
        return [1, 2, 3, 1, 2, 3, 1, 2]


FIXED = dict(num_tokens=4, adaptive=False)  # the prior costs, 1 + 0.1 k: no timing


def test_acceptance_shrinks_the_proposals_then_pauses_them_and_tries_again():
    speculator = Speculator(SpeculativeConfig(**FIXED))
    request = Decoding(budget=10_000)

    def fail_until_paused() -> list[int]:
        seen = []
        while (k := speculator.allowance(request)) > 0:
            seen.append(k)
            request.speculation = speculator.after(request, k, 0)
        return seen

    # all rejected, from a = 3/4 (2 steps' evidence): a halves each step (3/8, 3/16, 3/32); the k
    # of the largest (1 + a + .. + a^k) / (1 + 0.1 k): 4 (3.05 / 1.4), 2 (1.52 / 1.2), 1 (1.19 / 1.1),
    # then none is above 1 (1.09 / 1.1): paused
    assert fail_until_paused() == [4, 2, 1]
    assert request.speculation.resume_at == 10 + PAUSE_TOKENS
    request.generated += [7] * (PAUSE_TOKENS - 1)
    assert speculator.allowance(request) == 0
    request.generated.append(7)
    # tried again from a = 1/2 (1 step's evidence): 2 (1.75 / 1.2), then a = 1/6: 1 (1.17 / 1.1), then 1/14
    assert fail_until_paused() == [2, 1]
    assert request.speculation.resume_at == len(request.generated) + 2 * PAUSE_TOKENS  # paused twice as long
    for _ in range(6):
        request.generated += [7] * (request.speculation.resume_at - len(request.generated))
        fail_until_paused()
    assert request.speculation.resume_at - len(request.generated) == MAX_PAUSE_TOKENS
    request.speculation = Acceptance.of_rate(0.3, weight=1, pauses=3)
    request.speculation = speculator.after(request, 2, 2)  # all accepted: a climbs to (0.15 + 2) / (0.5 + 2)
    assert request.speculation == Acceptance(pytest.approx(2.15), pytest.approx(0.35), pauses=0)
    assert speculator.allowance(request) == 4
    request.speculation = speculator.after(request, 4, 1)  # (1.075 + 1) / (1.25 + 2): a = 0.64
    assert speculator.rate(request.speculation) == pytest.approx(2.075 / 3.25)
    assert speculator.allowance(request) == 3  # 2.37 / 1.3 against 2.52 / 1.4 for 4: 1.82 > 1.80
    assert (speculator.proposed_total, speculator.accepted_total) == (4 + 2 + 1 + 2 + 1 + 6 * 3 + 2 + 4, 3)


class ProposesAll:
    """A proposer with a guess for every token: each row proposes all it is allowed."""

    def propose(self, tokens, k):
        return [5] * k


class SimulatedRequest(Decoding):
    """A request whose step times and acceptances are made up (:func:`simulate`)."""

    def __init__(self, budget: int) -> None:
        super().__init__(generated=0, budget=budget)


def simulate(speculators: list[Speculator], accepted, cost, n: int = 400, draft_s: float = 0.0):
    """Generate ``n`` tokens for one request as the engine would with ``speculators`` (the first
    rank's first, timing its steps; the others given its shared ratios alone), where a step with
    ``k`` proposals of which ``accepted(step, k)`` are accepted takes ``cost(k)`` (a plain step:
    1.0) plus ``draft_s`` per proposal.  Returns (tokens per unit of time / a plain step's, the
    k of each step, every rank's proposals), asserting the ranks proposed alike."""
    requests = [SimulatedRequest(n) for _ in speculators]
    for speculator in speculators:
        speculator.proposer = ProposesAll()
    time_taken, steps, step = 0.0, [], 0
    while len(requests[0].generated) < n:
        shared = speculators[0].costs_to_share()
        proposals = []
        for speculator in speculators:
            if shared is not None:
                speculator.use_costs(shared)
        for speculator, request in zip(speculators, requests):
            proposals.append(speculator.proposals([request]).get(0, []))
        assert all(p == proposals[0] for p in proposals), "the ranks proposed differently"
        k = len(proposals[0])
        seconds = cost(k) + draft_s * k
        time_taken += seconds
        got = min(accepted(step, k), k) if k else 0
        for rank, (speculator, request) in enumerate(zip(speculators, requests)):
            if k:
                request.speculation = speculator.after(request, k, got)
            speculator.observe(1, 1 + k, False, seconds if rank == 0 else None)
            request.generated += [7] * min(got + 1, n - len(request.generated))
        steps.append(k)
        step += 1
    assert all(r.speculation == requests[0].speculation for r in requests)
    return n / time_taken, steps


def verifying_cost(k: int) -> float:
    return 1.0 + 0.15 * k  # a verifying step's pass: 1.6 plain steps at k = 4


def test_a_costly_proposer_accepted_a_quarter_of_the_time_is_turned_off():
    """The trained pair's case (24 % accepted, the draft's forwards as dear as the target's):
    after the first steps it proposes only to probe, and costs at most a few per cent."""
    def quarter(step, k):
        return 1 if step % 4 == 0 else 0  # about a quarter of the first proposals accepted

    speculators = [Speculator(SpeculativeConfig(num_tokens=4)) for _ in range(2)]
    speed, steps = simulate(speculators, quarter, verifying_cost, draft_s=0.4)
    assert steps[:MIN_TIMED] == [0] * MIN_TIMED  # plain steps timed first
    first_pause = steps.index(0, MIN_TIMED)
    assert first_pause <= MIN_TIMED + 5  # turned off within 5 verifying steps
    assert sum(1 for k in steps if k) <= 12  # then only probes: 16, 32, 64, 128 tokens apart
    assert speed >= 0.95


def test_a_proposer_always_wrong_costs_little_and_a_later_request_starts_paused():
    speculator = Speculator(SpeculativeConfig(num_tokens=4))
    speed, steps = simulate([speculator], lambda step, k: 0, verifying_cost)
    # 4, 2, 1 (paused), then 2 probing steps at 16, 32, 64 and 128 tokens
    assert speed >= 0.97 and sum(1 for k in steps if k) <= 12
    # adaptive: a new request starts from the engine's recent acceptance, ~0: it proposes 1 (a
    # probe) and is paused after it
    speed, steps = simulate([speculator], lambda step, k: 0, verifying_cost)
    assert steps[:2] == [1, 0] and speed >= 0.98


def test_a_cheap_accurate_proposer_is_kept_at_its_best_k():
    speculator = Speculator(SpeculativeConfig(num_tokens=4))
    speed, steps = simulate([speculator], lambda step, k: k if step % 10 else k - 1, verifying_cost, n=1200)
    # MIN_TIMED plain steps first and one after each REMEASURE_STEPS verifying ones; all the others
    # propose 4
    assert steps.count(0) == MIN_TIMED + (len(steps) - MIN_TIMED) // (REMEASURE_STEPS + 1)
    assert set(steps[:-1]) == {0, 4}  # (the last step has room for fewer)
    assert speed >= 2.5  # ~4.9 tokens per 1.6 plain steps
    # the same proposer made dear (each proposal 1.5 plain steps): it proposes nothing but probes
    speed, steps = simulate([Speculator(SpeculativeConfig(num_tokens=4))], lambda step, k: 0 if step < 3 else k,
                            lambda k: 1.0 + 1.5 * k)
    assert speed >= 0.95 and sum(1 for k in steps if k) <= 10


def test_probing_resumes_and_a_proposer_that_became_right_is_taken_up_again():
    speculator = Speculator(SpeculativeConfig(num_tokens=4))
    wrong_until = 40  # steps: then always right
    speed, steps = simulate([speculator], lambda step, k: 0 if step < wrong_until else k, verifying_cost, n=600)
    paused = steps.index(0, MIN_TIMED)
    assert paused <= MIN_TIMED + 3 and steps[paused:paused + 10] == [0] * 10
    probes = [i for i in range(paused, wrong_until) if steps[i]]
    assert 1 <= len(probes) <= 3  # 16 and 32 tokens later (1 token a step while paused)
    later = steps[wrong_until + 40:]
    assert later.count(4) >= 0.9 * len(later)  # taken up again at the next probe after it became right


def test_the_ranks_decide_alike_from_the_first_rank_s_times():
    """Only the first rank times its steps; the others read the ratios it shares: the same
    proposals at every step (simulate asserts it), whatever the other ranks' own times were."""
    speculators = [Speculator(SpeculativeConfig(num_tokens=4)) for _ in range(3)]
    simulate(speculators, lambda step, k: k // 2, lambda k: 1.0 + 0.5 * k, n=300)
    assert speculators[1].costs == speculators[2].costs == speculators[0].costs != {}


def test_proposals_respect_the_budget_the_settings_and_the_batch():
    speculator = Speculator(SpeculativeConfig(num_tokens=4, disable_by_batch_size=2, adaptive=False))
    request = Decoding(generated=10, budget=12)
    request.speculation = Acceptance.of_rate(1.0)
    assert speculator.allowance(request) == 1  # 2 more tokens: the step's first + 1
    assert speculator.allowance(Decoding(generated=10, budget=11)) == 0
    assert speculator.allowance(Decoding(speculative=False)) == 0
    rows = [Decoding(), Decoding()]
    rows[1].id = 1
    for row in rows:
        row.speculation = Acceptance.of_rate(1.0)
    assert speculator.proposals(rows) == {0: [3, 1, 2], 1: [3, 1, 2]}
    assert speculator.proposals(rows + [Decoding()]) == {}  # more rows than disable_by_batch_size
    # a decoding pass feeds at most MAX_STEP_POSITIONS (10) positions: rows x (1 + proposals)
    wide = Speculator(SpeculativeConfig(num_tokens=4, disable_by_batch_size=8, adaptive=False))
    for n, most in ((1, 3), (2, 3), (3, 2), (4, 1), (5, 1), (6, 0)):
        rows = [Decoding() for _ in range(n)]
        for i, row in enumerate(rows):
            row.id, row.speculation = i, Acceptance.of_rate(1.0)
        proposals = wide.proposals(rows)
        assert [len(proposals.get(i, [])) for i in range(n)] == [most] * n


@pytest.mark.parametrize("num_tokens, disable, max_rows", [(4, 4, 4), (4, 8, 8), (16, 8, 3), (1, 4, 6), (2, 1, 4)])
def test_the_verified_shapes_are_every_shape_a_step_proposes(num_tokens, disable, max_rows):
    """The shapes a compiled verification step is compiled for (SpeculativeConfig.verified_shapes)
    are exactly the (rows, 1 + the most proposed by a row) of the Speculator's steps: every
    batch of 1 to max_rows rows whose requests may propose 0 to num_tokens tokens each."""
    config = SpeculativeConfig(num_tokens=num_tokens, disable_by_batch_size=disable, adaptive=False)
    speculator = Speculator(config, ProposesAll())
    seen = set()
    rng = random.Random(num_tokens * 100 + disable)
    for n in range(1, max_rows + 1):
        for _ in range(200):
            rows, most = [], rng.randint(0, num_tokens)
            for i in range(n):
                # the budget caps a row's allowance: 1 + k more tokens, k in 0..most
                row = Decoding(generated=10, budget=11 + rng.randint(0, most))
                row.id, row.speculation = i, Acceptance.of_rate(1.0)
                rows.append(row)
            proposals = speculator.proposals(rows)
            if proposals:
                seen.add((n, 1 + max(len(p) for p in proposals.values())))
    assert seen == set(config.verified_shapes(max_rows))
    assert all(rows * width <= 10 for rows, width in seen)


# -- the acceptance rule's distribution --------------------------------------------------------

VOCAB = 3
LENGTH = 3  # tokens per sampled sequence
SAMPLING = SamplingParams(temperature=0.8, top_p=0.9)


def target_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """The 'model': logits over VOCAB tokens after ``prefix``, fixed per prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % 2**31)
    return torch.randn(VOCAB, generator=g) * 1.5


def target_probs(prefix: tuple[int, ...]) -> torch.Tensor:
    """The distribution a step draws from, computed here: temperature, then Meta's top-p."""
    probs = torch.softmax(target_logits(prefix).double() / SAMPLING.temperature, -1)
    ordered, order = torch.sort(probs, descending=True)
    kept = torch.zeros_like(probs).scatter_(0, order, nucleus(ordered.unsqueeze(0), SAMPLING.top_p)[0])
    return kept / kept.sum()


def proposals_for(prefix: tuple[int, ...]) -> list[int]:
    """Proposals of both kinds: often the likeliest token, often not."""
    return [(sum(prefix) + j) % VOCAB for j in (1, 2)]


class Row:
    """What the sampler reads of a request."""

    def __init__(self, generator: torch.Generator) -> None:
        self.id, self.processor, self.matcher, self.generated = 0, None, None, []
        self.sampling, self.generator = SAMPLING, generator


def engine_rule(sampler: Sampler, row: Row):
    def choose(prefix: tuple[int, ...], proposed: list[int]) -> list[int]:
        logits = torch.stack([target_logits(prefix + tuple(proposed[:j])) for j in range(len(proposed) + 1)])
        tokens, errors, accepted = sampler.sample([row], logits, [0], {0: proposed} if proposed else None)
        assert not errors
        return proposed[: accepted.get(0, 0)] + tokens
    return choose


def wrong_rule(generator: torch.Generator):
    """A rule that looks right and is not: accept a proposal with its probability, else draw from
    the whole distribution (the proposal's mass not taken out)."""
    def choose(prefix: tuple[int, ...], proposed: list[int]) -> list[int]:
        out: list[int] = []
        for d in proposed:
            p = target_probs(prefix + tuple(out))
            if torch.rand((), generator=generator, dtype=torch.float64) < p[d]:
                out.append(d)
                continue
            out.append(int(torch.multinomial(p, 1, generator=generator)))
            return out
        return out + [int(torch.multinomial(target_probs(prefix + tuple(out)), 1, generator=generator))]
    return choose


def sequence_counts(choose, n: int) -> dict[tuple[int, ...], int]:
    """``n`` sequences of LENGTH tokens, each step verifying the proposals that fit."""
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        seq: tuple[int, ...] = ()
        while len(seq) < LENGTH:
            room = LENGTH - len(seq) - 1
            seq += tuple(choose(seq, proposals_for(seq)[:room]))
        counts[seq] = counts.get(seq, 0) + 1
    return counts


def chi_square(counts: dict[tuple[int, ...], int], n: int) -> tuple[float, float]:
    """(Pearson's statistic of ``counts`` against the exact law of the sequences, its 0.1%
    critical value (Wilson-Hilferty)); a sequence of probability 0 seen at all fails."""
    stat, cells = 0.0, 0
    for seq in [(a, b, c) for a in range(VOCAB) for b in range(VOCAB) for c in range(VOCAB)]:
        p = math.prod(float(target_probs(seq[:i])[seq[i]]) for i in range(LENGTH))
        if p == 0:
            assert seq not in counts, f"{seq} has probability 0 and was drawn"
            continue
        cells += 1
        stat += (counts.get(seq, 0) - n * p) ** 2 / (n * p)
    df = cells - 1
    z = 3.09  # the normal's 99.9% quantile
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_sampled_runs_follow_the_target_distribution():
    """3-token sequences drawn with proposals verified by the engine's sampler have the target's
    law (chi-square at 0.1%); the wrong rule above, on as many, does not."""
    n = 600
    sampler = Sampler(VOCAB, torch.Generator(), torch.device("cpu"), first_rank=True, multi_rank=False)
    row = Row(torch.Generator().manual_seed(11))
    stat, critical = chi_square(sequence_counts(engine_rule(sampler, row), n), n)
    assert stat < critical, (stat, critical)
    wrong, critical = chi_square(sequence_counts(wrong_rule(torch.Generator().manual_seed(11)), n), n)
    assert wrong > 3 * critical, (wrong, critical)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.8, None, 0.9), (1.3, None, 1.0), (0.7, 3, 0.8),
                                                      (1.0, 4, 1.0), (0.5, 50, 0.95)])
def test_the_distribution_a_step_draws_from_is_written_out(temperature, top_k, top_p):
    """sampling_distribution (what the rule's p and a draft's q are) against Meta's steps written
    plainly: temperature, the top-k, the smallest most likely set whose mass before each token is
    at most top_p; and against the frequencies of sample_next_token's draws."""
    from llama.engine.sampling import sample_next_token

    logits = torch.randn(2, 7, generator=torch.Generator().manual_seed(4)) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = sampling_distribution(logits, params)
    for row in range(2):
        probs = torch.softmax(logits[row].double() / temperature, -1)
        order = torch.argsort(probs, descending=True).tolist()[: top_k or 7]  # the top-k, renormalised
        within = {t: float(probs[t]) / sum(float(probs[u]) for u in order) for t in order}
        kept, mass = {}, 0.0
        for t in order:
            if mass > top_p:
                break
            kept[t] = within[t]
            mass += within[t]
        total = sum(kept.values())
        want = [kept.get(t, 0.0) / total for t in range(7)]
        assert got[row].tolist() == pytest.approx(want, abs=1e-6)
    draws = sample_next_token(logits[:1].expand(4000, 7).contiguous(), params, torch.Generator().manual_seed(5))
    freq = torch.bincount(draws, minlength=7).double() / 4000
    assert freq.tolist() == pytest.approx(got[0].tolist(), abs=0.03)


def draft_probs(prefix: tuple[int, ...]) -> torch.Tensor:
    """A draft's distribution after ``prefix``, unlike the target's: near uniform (so it proposes
    tokens the target's top-p never draws, and the likeliest too seldom), its own logits."""
    g = torch.Generator().manual_seed(hash((7919,) + prefix) % 2**31)
    return torch.softmax(torch.randn(VOCAB, generator=g, dtype=torch.float64) * 0.2, -1)


def draft_rule(sampler: Sampler, row: Row, draws: torch.Generator):
    """Proposals drawn from the draft's distribution (``draws``), verified by the engine's sampler
    with those distributions."""
    def choose(prefix: tuple[int, ...], room: int) -> list[int]:
        proposed: list[int] = []
        qs = []
        for _ in range(room):
            q = draft_probs(prefix + tuple(proposed))
            proposed.append(int(torch.multinomial(q, 1, generator=draws)))
            qs.append(q)
        logits = torch.stack([target_logits(prefix + tuple(proposed[:j])) for j in range(len(proposed) + 1)])
        tokens, errors, accepted = sampler.sample([row], logits, [0], {0: proposed} if proposed else None,
                                                  {0: torch.stack(qs)} if proposed else None)
        assert not errors
        return proposed[: accepted.get(0, 0)] + tokens
    return choose


def wrong_draft_rule(generator: torch.Generator, draws: torch.Generator):
    """The rule as it is often misremembered: accept a draft's proposal with probability p(d)
    (not min(1, p(d) / q(d))), else draw from max(0, p - q) normalised."""
    def choose(prefix: tuple[int, ...], room: int) -> list[int]:
        out: list[int] = []
        for _ in range(room):
            q = draft_probs(prefix + tuple(out))
            d = int(torch.multinomial(q, 1, generator=draws))
            p = target_probs(prefix + tuple(out))
            if torch.rand((), generator=generator, dtype=torch.float64) < p[d]:
                out.append(d)
                continue
            residual = (p - q).clamp(min=0)
            out.append(int(torch.multinomial(residual if residual.sum() > 0 else p, 1, generator=generator)))
            return out
        return out + [int(torch.multinomial(target_probs(prefix + tuple(out)), 1, generator=generator))]
    return choose


def draft_sequence_counts(choose, n: int) -> dict[tuple[int, ...], int]:
    """``n`` sequences of LENGTH tokens, each step proposing as many as fit."""
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n):
        seq: tuple[int, ...] = ()
        while len(seq) < LENGTH:
            seq += tuple(choose(seq, LENGTH - len(seq) - 1))
        counts[seq] = counts.get(seq, 0) + 1
    return counts


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_runs_of_a_draft_s_sampled_proposals_follow_the_target_distribution():
    """Proposals drawn from a distribution q of their own (a draft model's) that differs from the
    target's: the sampler's general rule (accept with min(1, p/q), else draw from max(0, p - q))
    gives 3-token sequences of the target's law; accepting with probability p(d) does not."""
    n = 600
    assert max(float((draft_probs(s) - target_probs(s)).abs().max()) for s in [(), (0,), (1,), (2,)]) > 0.3
    sampler = Sampler(VOCAB, torch.Generator(), torch.device("cpu"), first_rank=True, multi_rank=False)
    row = Row(torch.Generator().manual_seed(12))
    stat, critical = chi_square(draft_sequence_counts(draft_rule(sampler, row, torch.Generator().manual_seed(13)), n),
                                n)
    assert stat < critical, (stat, critical)
    wrong, critical = chi_square(draft_sequence_counts(
        wrong_draft_rule(torch.Generator().manual_seed(12), torch.Generator().manual_seed(13)), n), n)
    assert wrong > 3 * critical, (wrong, critical)


def test_a_run_draws_as_steps_without_proposals_do():
    """With the same generator, the tokens of verified runs are the tokens drawn one per step."""
    sampler = Sampler(VOCAB, torch.Generator(), torch.device("cpu"), first_rank=True, multi_rank=False)
    spec, plain = Row(torch.Generator().manual_seed(3)), Row(torch.Generator().manual_seed(3))
    with_proposals = engine_rule(sampler, spec)
    without = engine_rule(sampler, plain)
    for _ in range(50):
        seq: tuple[int, ...] = ()
        one_by_one: tuple[int, ...] = ()
        while len(seq) < 6:
            seq += tuple(with_proposals(seq, proposals_for(seq)[: 6 - len(seq) - 1]))
        while len(one_by_one) < 6:
            one_by_one += tuple(without(one_by_one, []))
        assert seq == one_by_one


# -- the engine: the demo model ----------------------------------------------------------------

N_NEW = 40  # tokens of the demo's replies


def steady(engine: Engine) -> Engine:
    """``engine`` with its speculative rule timing steps by a clock that counts its reads: every
    step takes 1, so its decisions (what each step proposes) do not depend on how busy the
    machine is (the rule itself is tested with made-up times above, and in torchrun jobs)."""
    if engine.speculator is not None:
        engine.speculator.clock = itertools.count().__next__
    return engine


def demo(**kw) -> Llama:
    llama = Llama.build(DEMO, DEMO / "tokenizer.model", max_seq_len=256, max_batch_size=4, device="cpu",
                        dtype="float32", compile=False, **kw)
    steady(llama.engine)
    return llama


@pytest.fixture(scope="module")
def pair():
    """The demo model twice: without speculation (the reference) and with it."""
    return demo(), demo(speculative=NGRAM)


def submit(llama: Llama, prompt: str, events: Optional[list] = None, **settings):
    tokens = llama.tokenizer.encode(prompt, bos=True, eos=False)
    return llama.engine.submit(tokens, RequestSettings(**settings), on_event=events.append if events is not None
                               else None)


def run(llama: Llama, prompts: list[str], **settings) -> list:
    handles = [submit(llama, p, **settings) for p in prompts]
    return [h.result() for h in handles]


def counters(llama: Llama) -> tuple[int, int]:
    stats = llama.engine.stats()
    return stats["spec_proposed_tokens_total"], stats["spec_accepted_tokens_total"]


def token_events(events: list) -> list[TokenEvent]:
    return [e for e in events if isinstance(e, TokenEvent) and e.token is not None]


@pytest.fixture(scope="module")
def reference_reply(pair):
    """The reference's greedy reply to QUOTING (log-probabilities and 3 alternatives each) and
    its events."""
    events: list = []
    result = submit(pair[0], QUOTING, events, max_new_tokens=N_NEW, temperature=0, logprobs=True,
                    top_logprobs=3).result()
    return result, token_events(events)


def run_structure(engine: Engine, prompt: list[int], **settings) -> tuple[list[int], list[int], list]:
    """(the tokens, how many each step gave, the events) of one request, stepped by hand."""
    events: list = []
    handle = engine.submit(prompt, RequestSettings(**settings), on_event=events.append)
    per_step = []
    while not handle.finished:
        before = len(events)
        engine.step()
        per_step.append(len(token_events(events[before:])))
    return handle.result().tokens, [n for n in per_step if n], events


def inside_a_run(steps: list[int]) -> list[int]:
    """Token indices that a step gave with more tokens after them in the same step."""
    out, start = [], 0
    for n in steps:
        out += list(range(start, start + n - 1))
        start += n
    return out


@pytest.fixture(scope="module")
def speculated_reply(pair):
    """The speculating engine's reply to QUOTING (as the reference's), stepped by hand: its
    tokens, how many each step gave, its events."""
    spec = pair[1]
    before = counters(spec)
    prompt = spec.tokenizer.encode(QUOTING, bos=True, eos=False)
    out = run_structure(spec.engine, prompt, max_new_tokens=N_NEW, temperature=0, logprobs=True, top_logprobs=3)
    proposed, accepted = (a - b for a, b in zip(counters(spec), before))
    assert 0 < accepted < proposed  # proposals were accepted and rejected
    return out


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_greedy_tokens_are_the_same_alone(pair, reference_reply, speculated_reply):
    plain, spec = pair
    assert speculated_reply[0] == reference_reply[0].tokens
    assert max(speculated_reply[1]) > 1  # steps gave several tokens
    assert run(spec, [PLAIN], max_new_tokens=20, temperature=0)[0].tokens == \
        run(plain, [PLAIN], max_new_tokens=20, temperature=0)[0].tokens


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_greedy_tokens_are_the_same_batched_with_requests_that_do_not_speculate(pair):
    plain, spec = pair
    prompts = [QUOTING, PLAIN, QUOTING[:80]]
    before = counters(spec)
    handles = [submit(spec, p, max_new_tokens=32, temperature=0, speculative=i != 1) for i, p in enumerate(prompts)]
    assert [h.result().tokens for h in handles] == \
        [r.tokens for r in run(plain, prompts, max_new_tokens=32, temperature=0)]
    assert counters(spec)[1] > before[1]


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_streaming_tells_each_token_of_a_run_in_order(reference_reply, speculated_reply):
    tokens, steps, events = speculated_reply
    result, want = reference_reply
    got = token_events(events)
    assert [e.token for e in got] == tokens == result.tokens
    assert "".join(e.text for e in events[:-1]) == result.text
    assert [o for e in got for o in e.final_offsets] == [o for e in want for o in e.final_offsets]


def test_log_probabilities_are_the_target_s(reference_reply, speculated_reply):
    """Within 1e-4: the same logits, computed over a step's several positions at once."""
    _, _, events = speculated_reply
    result, want = reference_reply
    got = token_events(events)
    assert [e.logprob for e in got] == pytest.approx(result.logprobs, abs=1e-4)
    for a, b in zip(got, want):
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        assert [v for _, v in a.top_logprobs] == pytest.approx([v for _, v in b.top_logprobs], abs=1e-4)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_stop_string_inside_a_run_ends_the_reply_where_it_would(pair, reference_reply, speculated_reply):
    plain, spec = pair
    full = reference_reply[0]
    # the shortest text ending with a token given inside a run (tokens of that step after it)
    # that first occurs there: the reply with it as its stop string ends inside that run
    i = inside_a_run(speculated_reply[1])[0]
    end, text = full.text_offsets[i + 1], full.text
    start = next(s for s in range(end - 1, -1, -1) if text[s:end].strip() and text.find(text[s:end]) == s)
    stop = text[start:end]
    got, want = (run(llama, [QUOTING], max_new_tokens=N_NEW, temperature=0, stop=(stop,))[0] for llama in pair)
    assert (got.tokens, got.text, got.finish_reason) == (want.tokens, want.text, "stop")
    assert got.all_tokens == want.all_tokens == full.tokens[: i + 1]  # the tokens after the stop were discarded


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_max_tokens_ends_the_reply_where_it_would(pair, reference_reply, speculated_reply):
    spec = pair[1]
    ends = [i + 1 for i in inside_a_run(speculated_reply[1])][:4]  # ends inside a run
    for n in ends + [1]:
        got = run(spec, [QUOTING], max_new_tokens=n, temperature=0)[0]
        assert got.tokens == reference_reply[0].tokens[:n] and got.finish_reason == "length"


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_seeded_request_gives_the_same_text_with_and_without_speculation(pair):
    plain, spec = pair
    settings = dict(max_new_tokens=30, temperature=0.7, top_p=0.9, seed=5)
    before = counters(spec)
    first, again = run(spec, [LOOP], **settings)[0], run(spec, [LOOP], **settings)[0]
    assert first.tokens == again.tokens == run(plain, [LOOP], **settings)[0].tokens
    assert counters(spec)[1] > before[1]


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_logits_processor_sees_each_position_s_history(pair):
    """A processor that bans a token after one it follows in the reply (a rule on the history)
    gives the same reply with proposals verified as without."""
    plain, spec = pair
    the = spec.tokenizer.encode(" the", bos=False, eos=False)[-1]
    world = spec.tokenizer.encode(" world", bos=False, eos=False)[-1]
    calls = []

    def processor(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        calls.append(tokens.shape[-1])
        if tokens[0, -1] == the:
            logits[:, world] = float("-inf")
        return logits

    settings = dict(max_new_tokens=30, temperature=0, logits_processor=processor)
    got = run(spec, [QUOTING], **settings)[0].tokens
    spec_calls, calls[:] = list(calls), []
    assert got == run(plain, [QUOTING], **settings)[0].tokens
    assert spec_calls == calls  # called once per position reached, with each history, in order


# -- blocks, the prefix cache, preemption ------------------------------------------------------


class AlwaysWrong:
    """Proposes one token again and again (one the model never chooses, in the tests)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, tokens, k):
        return [self.token] * k


class Replaying:
    """Proposes what a reference run generated after the same tokens, every third proposal
    spoiled (``wrong``; -1: none): long accepted runs and rejections mid-run."""

    def __init__(self, sequences: list[list[int]], wrong: int) -> None:
        self.sequences, self.wrong = sequences, wrong

    def propose(self, tokens, k):
        for seq in self.sequences:
            if seq[: len(tokens)] == list(tokens):
                out = seq[len(tokens) : len(tokens) + k]
                return [self.wrong if self.wrong >= 0 and (len(tokens) + j) % 3 == 0 else t
                        for j, t in enumerate(out)]
        return []


def tiny_engine(checkpoint, proposer, **kw) -> Engine:
    llama = helpers.build(checkpoint, max_seq_len=64, max_batch_size=4, dtype="float32", compile=False)
    options = {"kv_cache_tokens": 96, "block_size": 4, **kw}
    return steady(Engine(llama.model, llama.tokenizer, generator=torch.Generator().manual_seed(0),
                         speculative={"method": "ngram", "num_tokens": 4}, proposer=proposer, **options))


def tiny_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 250) for _ in range(n - 1)]


_REFERENCE: dict = {}


def reference(checkpoint, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of ``prompt`` on a fresh engine without speculation."""
    key = (tuple(prompt), n)
    if key not in _REFERENCE:
        llama = helpers.build(checkpoint, max_seq_len=64, max_batch_size=4, dtype="float32", compile=False)
        _REFERENCE[key] = llama.engine.submit(prompt, RequestSettings(max_new_tokens=n, temperature=0)).result().tokens
    return _REFERENCE[key]


def check_books(engine: Engine) -> None:
    """The pool is consistent with the tables, and a decoding request holds no block beyond its
    next token's (those of rejected positions went back)."""
    engine.kv.blocks.check([engine.kv.block_ids(r) for r in engine.scheduler.running])
    for request in engine.scheduler.running.values():
        if not request.prefilling and request.pending is not None:
            assert engine.kv.held(request.id) <= engine.kv.blocks.blocks_for(request.n_fed + 1)


def run_all(engine: Engine, handles) -> None:
    while not all(h.finished for h in handles):
        engine.step()
        check_books(engine)


def all_blocks_back(engine: Engine) -> None:
    assert not engine.scheduler.running and not engine.scheduler.preempted
    engine.kv.blocks.check([])
    assert engine.kv.blocks.available == engine.kv.blocks.usable


def test_rejected_positions_never_reach_the_prefix_cache(llama3_checkpoint):
    """Every proposal rejected, over block boundaries: the reply is the reference's, and a later
    request that reuses the cached blocks of the whole sequence gets the log-probabilities of a
    fresh run (K/V of a rejected token in a cached block would change them)."""
    prompt = tiny_prompt(1, 9)
    ref = reference(llama3_checkpoint, prompt, 20)
    wrong = next(t for t in range(3, 250) if t not in ref)  # never chosen: every proposal rejected
    engine = tiny_engine(llama3_checkpoint, AlwaysWrong(wrong))
    first = engine.submit(prompt, RequestSettings(max_new_tokens=20, temperature=0))
    run_all(engine, [first])
    assert first.result().tokens == ref
    assert engine.stats()["spec_proposed_tokens_total"] > 0 and engine.stats()["spec_accepted_tokens_total"] == 0
    follow = prompt + first.result().tokens
    cached = engine.submit(follow, RequestSettings(max_new_tokens=8, temperature=0, logprobs=True)).result()
    assert cached.n_cached_prompt_tokens >= 24
    fresh = helpers.build(llama3_checkpoint, max_seq_len=64, max_batch_size=4, dtype="float32", compile=False)
    want = fresh.engine.submit(follow, RequestSettings(max_new_tokens=8, temperature=0, logprobs=True)).result()
    assert cached.tokens == want.tokens and cached.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    all_blocks_back(engine)


def test_accepted_runs_enter_the_prefix_cache(llama3_checkpoint):
    """Long accepted runs (a replayed reference, every third proposal spoiled): the reply is the
    reference's; the blocks it filled are reused by a later request, with a fresh run's
    log-probabilities."""
    prompt = tiny_prompt(2, 7)
    ref = reference(llama3_checkpoint, prompt, 30)
    engine = tiny_engine(llama3_checkpoint, Replaying([prompt + ref], wrong=5))
    handle = engine.submit(prompt, RequestSettings(max_new_tokens=30, temperature=0))
    run_all(engine, [handle])
    assert handle.result().tokens == ref
    stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens_total"] < stats["spec_proposed_tokens_total"]
    follow = prompt + ref[:25]
    cached = engine.submit(follow, RequestSettings(max_new_tokens=5, temperature=0, logprobs=True)).result()
    assert cached.n_cached_prompt_tokens >= 28  # 7 whole blocks at least
    fresh = helpers.build(llama3_checkpoint, max_seq_len=64, max_batch_size=4, dtype="float32", compile=False)
    want = fresh.engine.submit(follow, RequestSettings(max_new_tokens=5, temperature=0, logprobs=True)).result()
    assert cached.tokens == want.tokens and cached.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    all_blocks_back(engine)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(2, 30), st.integers(1, 30), st.booleans(), st.booleans()),
                min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_random_traffic_of_speculating_requests_keeps_the_books_straight(llama3_checkpoint, requests, rng):
    """Speculating requests (replayed references, spoiled now and then, and prompt lookup) of random
    lengths arriving, cancelled and preempted at random steps in a small pool: the books balance
    after every step, a decoding request holds no block beyond its next token's, every request
    not cancelled gets the reference's tokens, and every block is back at the end."""
    prompts = [tiny_prompt(family, n) for family, n, _, _, _ in requests]
    refs = [reference(llama3_checkpoint, p, new) for p, (_, _, new, _, _) in zip(prompts, requests)]

    class Mixed:
        def propose(self, tokens, k):
            return (replay.propose(tokens, k) if len(tokens) % 2 else lookup.propose(tokens, k))

    replay, lookup = Replaying([p + r for p, r in zip(prompts, refs)], wrong=7), NgramProposer(3, 1)
    engine = tiny_engine(llama3_checkpoint, Mixed(), kv_cache_tokens=64)
    handles, cancelled = [], set()
    for (family, n, new, cancel, _), p in zip(requests, prompts):
        handles.append(engine.submit(p, RequestSettings(max_new_tokens=new, temperature=0)))
        for _ in range(rng.randrange(4)):
            engine.step()
            check_books(engine)
        if cancel:
            victim = rng.randrange(len(handles))
            handles[victim].cancel()
            cancelled.add(victim)
    run_all(engine, handles)
    for i, (h, ref) in enumerate(zip(handles, refs)):
        if i not in cancelled:
            assert h.result().tokens == ref
    all_blocks_back(engine)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_preempted_mid_run_and_resumed(llama3_checkpoint):
    """Four speculating requests in a pool too small for them: they are preempted and resumed,
    and each gets the reference's tokens."""
    prompts = [tiny_prompt(40 + i, 10 + 3 * i) for i in range(4)]
    refs = [reference(llama3_checkpoint, p, 30) for p in prompts]
    engine = tiny_engine(llama3_checkpoint, Replaying([p + r for p, r in zip(prompts, refs)], wrong=9),
                         kv_cache_tokens=64)
    handles = [engine.submit(p, RequestSettings(max_new_tokens=30, temperature=0)) for p in prompts]
    run_all(engine, handles)
    assert engine.stats()["preemptions_total"] > 0 and engine.stats()["spec_accepted_tokens_total"] > 0
    assert [h.result().tokens for h in handles] == refs
    all_blocks_back(engine)


# -- ranks ---------------------------------------------------------------------------------------


# Two gloo ranks speculating by prompt lookup: test_speculative_draft.py's
# test_two_ranks_give_the_tokens_of_one, whose torchrun job runs this engine too.


# -- the benchmark's table (benchmarks/bench_speculative.py) -------------------------------------


def bench_speculative():
    import sys

    sys.path.insert(0, str(helpers.REPO / "benchmarks"))
    import bench_speculative

    return bench_speculative


def bench_engine(checkpoint, dtype: str, **options):
    """A tiny engine speculating with the benchmark's proposer (what ``table`` sets up)."""
    bench = bench_speculative()
    llama = helpers.build(checkpoint, max_seq_len=64, max_batch_size=2, dtype=dtype, compile=False,
                          speculative={**NGRAM, **options})
    proposer = bench.BenchProposer()
    steady(llama.engine).speculator.proposer = proposer
    return llama.engine, proposer


def spec_counters(engine: Engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["spec_proposed_tokens_total"], stats["spec_accepted_tokens_total"]


def test_the_replaying_proposer_is_always_accepted_and_the_wrong_one_never(llama3_checkpoint):
    """float32: what the replay settles on is the replies without speculation (at the first
    run); replayed, every proposal is accepted; a token they never hold, none is; and the
    replies stay the same either way."""
    bench = bench_speculative()
    engine, proposer = bench_engine(llama3_checkpoint, "float32")
    prompts = [tiny_prompt(1, 9), tiny_prompt(2, 14)]
    plain = [reference(llama3_checkpoint, p, 16) for p in prompts]
    sequences, runs = bench.settle_replay(engine, proposer, prompts, 16)
    assert (sequences, runs) == ([p + r for p, r in zip(prompts, plain)], 1)
    before = spec_counters(engine)
    assert bench.generate(engine, prompts, 16, speculative=True) == plain
    proposed, accepted = (a - b for a, b in zip(spec_counters(engine), before))
    assert proposed >= 2 * 3 and accepted == proposed  # 16 tokens a request, at most 4 proposed a step

    proposer.mode = "wrong"
    proposer.wrong_token = next(t for t in range(3, 160) if all(t not in r for r in plain))
    before = spec_counters(engine)
    assert bench.generate(engine, prompts, 16, speculative=True) == plain
    proposed, accepted = (a - b for a, b in zip(spec_counters(engine), before))
    assert proposed > 0 and accepted == 0


@pytest.mark.slow  # several runs of two requests: ~2 s
def test_in_bfloat16_the_replay_settles_on_replies_that_replaying_runs_give(llama3_checkpoint):
    """Where a verifying pass rounds otherwise than a one-token pass, a run proposing the
    replies without speculation may leave them (on this checkpoint one of these two does, at
    a near tie): the replay keeps every reply the runs gave until a run gives no new one, and
    a replaying run after that gives replies it holds, nearly every proposal accepted."""
    bench = bench_speculative()
    # fixed costs: which positions are verified (where the rounding differs) depends on the run alone
    engine, proposer = bench_engine(llama3_checkpoint, "bfloat16", adaptive=False)
    engine.runner.threads = None  # one thread count throughout
    prompts = [tiny_prompt(7, 11), tiny_prompt(8, 7)]
    sequences, runs = bench.settle_replay(engine, proposer, prompts, 30)
    assert 1 < runs < 6 and len(sequences) > len(prompts)
    before = spec_counters(engine)
    got = bench.generate(engine, prompts, 30, speculative=True)
    assert all(p + r in sequences for p, r in zip(prompts, got))
    proposed, accepted = (a - b for a, b in zip(spec_counters(engine), before))
    assert proposed >= 2 * 6 and accepted >= 0.9 * proposed


def test_the_table_s_ratio_is_the_median_of_each_round_s_and_acceptance_is_of_all_rounds():
    bench = bench_speculative()
    measured = {"config": "150m", "threads": 2, "rows": ["b", "c"], "batches": {"1": {
        "none": [10.0, 20.0, 30.0],
        "b": {"rates": [30.0, 30.0, 30.0], "proposed": 40, "accepted": 20},  # rounds: 3.0, 1.5, 1.0
        "c": {"rates": [10.0, 20.0, 30.0], "proposed": 0, "accepted": 0}}}}
    header, rule, right, wrong = bench.table_lines([measured])
    assert header.split("|")[1:-1] == [" config ", " threads ", " batch ", " row ", " tok/s none ",
                                       " tok/s speculating ", " ratio ", " acceptance "]
    assert right == "| 150m | 2 | 1 | (b) always right | 20.0 [10.0-30.0] | 30.0 [30.0-30.0] | 1.50x | 50 % |"
    assert wrong.endswith("| 1.00x | none proposed |")


@pytest.mark.slow  # a table cell's engine, eager (LLAMA_COMPILE=0), of the tiny benchmark shape: ~10 s
def test_a_table_cell_measures_each_row_against_none(monkeypatch):
    bench = bench_speculative()
    monkeypatch.setenv("LLAMA_COMPILE", "0")
    threads = torch.get_num_threads()
    try:
        got = bench.cell(config="tiny", threads=1, batches="1,2", rows="a,b,c,d", new_tokens=6, reps=2,
                         dtype="float32", prompt_len=16)
    finally:
        torch.set_num_threads(threads)
    assert got["rows"] == ["a", "b", "c"]  # no trained pair for a random shape
    assert got["settle_runs"] == {1: 1, 2: 1} and not got["compiled"]  # float32: the replies without speculation
    for b in ("1", "2"):
        measured = got["batches"][b]
        assert len(measured["none"]) == 2 and all(len(measured[r]["rates"]) == 2 for r in "abc")
        assert measured["b"]["proposed"] > 0 and measured["b"]["accepted"] == measured["b"]["proposed"]
        assert measured["c"]["proposed"] > 0 and measured["c"]["accepted"] == 0


@pytest.mark.slow  # tools/train_demo.py in a process of its own, a few steps: ~15 s
def test_the_trained_draft_loads_with_the_demo_s_tokenizer_and_drafts_for_it(tmp_path, reference_reply):
    """The (d) row's draft, trained by tools/train_demo.py with the demo's tokenizer: the target
    takes it (the tokenizers are checked), and its proposals leave the greedy reply as it is; a
    second call finds it trained."""
    bench = bench_speculative()
    tiny = dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, multiple_of=32, seq_len=64, batch_size=2, steps=2,
                warmup=1, eval_every=2, eval_chunks=1, log_every=1)
    folder = bench.train_draft(str(tmp_path / "draft"), threads=1, **tiny)
    assert (folder / "tokenizer.model").read_bytes() == (DEMO / "tokenizer.model").read_bytes()
    import json

    params = json.loads((folder / "params.json").read_text())
    assert (params["dim"], params["n_layers"], params["vocab_size"]) == (32, 1, 4096)
    stamp = (folder / "consolidated.00.pth").stat().st_mtime_ns
    assert bench.train_draft(str(tmp_path / "draft"), threads=1, **tiny) == folder
    assert (folder / "consolidated.00.pth").stat().st_mtime_ns == stamp  # not trained again

    options = dict(max_seq_len=128, max_batch_size=1, device="cpu", dtype="float32", compile=False)
    drafted = Llama.build(DEMO, speculative={"method": "draft", "draft_ckpt_dir": str(folder), "num_tokens": 4},
                          **options)
    prompt = drafted.tokenizer.encode(QUOTING, bos=True, eos=False)
    settings = RequestSettings(max_new_tokens=20, temperature=0)
    want = reference_reply[0].tokens[:20]  # the demo's greedy reply without speculation
    assert drafted.engine.submit(prompt, settings).result().tokens == want
    assert drafted.engine.stats()["spec_proposed_tokens_total"] > 0
