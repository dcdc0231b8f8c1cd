"""Structured output under speculative decoding: a request with a grammar (``response_format``,
a forced ``tool_choice``) proposes, its proposals are cut where the grammar forbids them, each
verified position is chosen under the mask of the grammar after the tokens before it, and the
reply is the one it gets without speculation.

References: an engine of the same checkpoint with speculation off (greedy tokens, seeded
samples, stop strings, tool calls); llguidance matchers advanced token by token here (the
masks after proposals, what a grammar allows); the plans the runner is given (no proposal
the grammar forbids is fed).  The demo model (Shakespeare, float32) quotes its prompt, so
prompt lookup's proposals are accepted and rejected; the tiny random checkpoint replays a
reference run with spoiled proposals."""

from __future__ import annotations

import random
import time

import pytest
import torch

import helpers
from llama import Llama
from llama.engine import Engine, RequestSettings
from llama.structured import GrammarMasker, GrammarTokenizer, compile_response_format
from llama.tokenizer import load_tokenizer
from test_grammar import json_schema_format
from test_speculative import steady

DEMO = helpers.REPO / "demo"
NGRAM = {"method": "ngram", "num_tokens": 4}
# Shakespeare the demo model continues by quoting it (as tests/test_speculative.py's).
QUOTING = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
           "Arise, fair sun, and kill the envious moon,\nWho is already sick and pale with grief.\n\n"
           "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east,")
TEXT = {"type": "regex", "regex": "[A-Za-z ,.;:!?'\\n]{1,400}"}  # the reply's text: letters and punctuation
LINE = {"type": "object", "properties": {"speaker": {"type": "string", "enum": ["ROMEO", "JULIET"]},
                                         "line": {"type": "string", "maxLength": 120}},
        "required": ["speaker", "line"], "additionalProperties": False}
QUOTED = '{"speaker": "ROMEO", "line": "But soft, what light through yonder window breaks? It is the east."}'
JSON_PROMPT = f"ROMEO:\n{QUOTED}\n{QUOTED}\n{QUOTED}\n"  # a prompt with the JSON the reply repeats


# -- the matcher: what a grammar allows after proposals ------------------------------------------


@pytest.fixture(scope="module")
def demo_grammar_tokenizer() -> GrammarTokenizer:
    """The demo's vocabulary as grammars see it, with BOS as a second end id (so that a request
    may have an end id of the tokenizer's that is not its own)."""
    return GrammarTokenizer(load_tokenizer(DEMO / "tokenizer.model"), end_ids={1, 2})


def test_valid_prefix_stops_where_the_grammar_forbids(demo_grammar_tokenizer):
    gt = demo_grammar_tokenizer
    grammar = compile_response_format({"type": "regex", "regex": " (yes|no) sir"}, gt)
    ids = gt.tokenizer.encode("yes sir", bos=False, eos=False)
    no = gt.tokenizer.encode("no", bos=False, eos=False)
    matcher = grammar.matcher(end_ids={2})
    assert matcher.valid_prefix(ids) == len(ids)
    assert matcher.valid_prefix(ids[:1] + no) == 1  # " y" then " no"
    assert matcher.valid_prefix(no + ids) == len(no)
    assert matcher.valid_prefix(ids + [2, 5]) == len(ids) + 1  # its end, and nothing after it
    assert matcher.valid_prefix(ids + [1]) == len(ids)  # an end id of the tokenizer's, not this request's
    assert matcher.valid_prefix([]) == 0
    assert matcher.allowed_ids() == grammar.matcher(end_ids={2}).allowed_ids()  # it did not move
    matcher.consume(ids[0])
    assert matcher.valid_prefix(ids[1:]) == len(ids) - 1


def test_the_masks_after_proposals_are_those_of_a_matcher_advanced_by_them(demo_grammar_tokenizer):
    """``fill_after`` on a copy: row j is the mask a matcher that consumed the first j + 1 tokens
    computes; it stops at the first token the grammar forbids; the request's matcher stays."""
    gt = demo_grammar_tokenizer
    grammar = compile_response_format(json_schema_format(LINE), gt)
    # (SentencePiece starts the text with a lone "▁" piece: not JSON)
    proposed = gt.tokenizer.encode('{"speaker": "HAMLET"', bos=False, eos=False)[1:]
    matcher = grammar.matcher(end_ids={2})
    n_ok = matcher.valid_prefix(proposed)
    assert gt.tokenizer.decode(proposed[n_ok:n_ok + 1]) == "HAM" and n_ok > 5  # not among the speakers
    out = torch.zeros((len(proposed), gt.words_per_mask), dtype=torch.int32)
    written = list(GrammarMasker(gt).fill_after(matcher.copy(), proposed, out))
    assert written == list(range(n_ok))
    step = grammar.matcher(end_ids={2})
    for j in written:
        step.consume(proposed[j])
        want = torch.zeros((1, gt.words_per_mask), dtype=torch.int32)
        step.fill_bitmask(want, 0)
        assert torch.equal(out[j], want[0]), j
    assert not out[n_ok:].any()  # nothing written past the refused token
    assert matcher.allowed_ids() == grammar.matcher(end_ids={2}).allowed_ids()  # the request's did not move


def test_a_job_stops_its_masks_after_proposals_at_the_step_s_deadline_and_after_a_slow_one(demo_grammar_tokenizer,
                                                                                           monkeypatch):
    """The masks after proposals are computed one after the other on a worker thread: the step
    takes those ready by its deadline (none computed after), and a mask that alone took longer
    than ``max_mask_s`` stops the ones after it; the first mask is the request's as always."""
    from llama.structured.matcher import MaskWorkers

    gt = demo_grammar_tokenizer
    grammar = compile_response_format(TEXT, gt)
    proposed = gt.tokenizer.encode("But soft what light through yonder", bos=False, eos=False)
    masker = GrammarMasker(gt)
    fill_after = GrammarMasker.fill_after

    def slowed(self, matcher, tokens, out):
        for j in fill_after(self, matcher, tokens, out):
            time.sleep(0.15)  # each mask after a proposal is ready 0.15 s after the one before
            yield j

    monkeypatch.setattr(GrammarMasker, "fill_after", slowed)
    workers = MaskWorkers(2)
    try:
        bitmask = torch.empty((2, gt.words_per_mask), dtype=torch.int32)
        matcher = grammar.matcher(end_ids={2})
        job = workers.submit(masker, matcher, bitmask, 0, proposed=proposed)
        n = job.take(time.monotonic() + 0.4)
        assert 1 <= n < 1 + len(proposed)  # 3 on an idle machine: the first, and two after proposals
        time.sleep(0.4)
        assert job.ready <= n + 1 and job.future.done()  # at most the one under way when taken
        reference = grammar.matcher(end_ids={2})
        assert torch.equal(job.bitmask()[0], _mask(reference))
        for j in range(n - 1):
            reference.consume(proposed[j])
            assert torch.equal(cast_draft(job)[j], _mask(reference)), j
        assert matcher.allowed_ids() == grammar.matcher(end_ids={2}).allowed_ids()  # computed on a copy

        limited = workers.submit(masker, grammar.matcher(end_ids={2}), bitmask, 1, proposed=proposed, max_mask_s=0.05)
        limited.future.result(timeout=5)
        assert limited.ready == 2  # the first after a proposal took 0.15 s > 0.05 s: no more
    finally:
        workers.shutdown()


def _mask(matcher) -> torch.Tensor:
    out = torch.zeros((1, matcher.tokenizer.words_per_mask), dtype=torch.int32)
    matcher.fill_bitmask(out, 0)
    return out[0]


def cast_draft(job) -> torch.Tensor:
    assert job.draft_bitmask is not None
    return job.draft_bitmask


# -- the engine: the demo model ------------------------------------------------------------------

N_NEW = 32


def demo(**kw) -> Llama:
    llama = Llama.build(DEMO, DEMO / "tokenizer.model", max_seq_len=256, max_batch_size=4, device="cpu",
                        dtype="float32", compile=False, **kw)
    steady(llama.engine)
    return llama


@pytest.fixture(scope="module")
def pair():
    """The demo model twice: without speculation (the reference) and with it."""
    return demo(), demo(speculative=NGRAM)


FORMATS = {"regex": TEXT, "json_schema": json_schema_format(LINE)}
PROMPTS = {"regex": QUOTING, "json_schema": JSON_PROMPT}


_GRAMMARS: dict = {}


def grammar_of(llama: Llama, response_format):
    """``response_format`` compiled once (in this process) for the demo's tokenizer."""
    key = repr(response_format)
    if key not in _GRAMMARS:
        if "tokenizer" not in _GRAMMARS:
            _GRAMMARS["tokenizer"] = GrammarTokenizer(llama.tokenizer)
        _GRAMMARS[key] = compile_response_format(response_format, _GRAMMARS["tokenizer"])
    return _GRAMMARS[key]


def submit(llama: Llama, prompt: str, response_format=None, events=None, **settings):
    tokens = llama.tokenizer.encode(prompt, bos=True, eos=False)
    grammar = grammar_of(llama, response_format) if response_format is not None else None
    return llama.engine.submit(tokens, RequestSettings(grammar=grammar, **settings),
                               on_event=events.append if events is not None else None)


def counters(llama: Llama) -> tuple[int, int]:
    stats = llama.engine.stats()
    return stats["spec_proposed_tokens_total"], stats["spec_accepted_tokens_total"]


@pytest.fixture(scope="module")
def alone(pair):
    """Each kind's constrained greedy reply (log-probabilities too), alone: with speculation,
    stepped by hand (the indices of the tokens a step gave with more after them, inside a run),
    with the proposals it made and the accepted; and without (the reference)."""
    from llama.engine import TokenEvent

    plain, spec = pair
    out = {}
    for kind in sorted(FORMATS):
        settings = dict(max_new_tokens=N_NEW, temperature=0, logprobs=True)
        events: list = []
        before = counters(spec)
        handle = submit(spec, PROMPTS[kind], FORMATS[kind], events, **settings)
        inside, given = [], 0
        while not handle.finished:
            seen = len(events)
            spec.engine.step()
            n = sum(1 for e in events[seen:] if isinstance(e, TokenEvent) and e.token is not None)
            inside += list(range(given, given + n - 1))
            given += n
        proposed, accepted = (a - b for a, b in zip(counters(spec), before))
        want = submit(plain, PROMPTS[kind], FORMATS[kind], **settings).result()
        out[kind] = handle.result(), inside, proposed, accepted, want
    return out


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_greedy_constrained_tokens_are_the_same_alone(alone, kind):
    """The reply quotes its prompt: proposals are accepted and rejected, and the tokens are the
    reference's, every one."""
    got, _, proposed, accepted, want = alone[kind]
    assert (got.tokens, got.text, got.finish_reason) == (want.tokens, want.text, want.finish_reason)
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)  # the masked distribution's
    assert 0 < accepted < proposed, (accepted, proposed)


@pytest.mark.slow  # (the tiny model's tests below batch and sample constrained requests quickly)
def test_greedy_constrained_tokens_are_the_same_batched_with_free_requests(pair):
    """Constrained requests (a regex, a schema) beside free ones that speculate and one that does
    not: each gets the reference's tokens."""
    plain, spec = pair
    requests = [(QUOTING, TEXT, True), (JSON_PROMPT, json_schema_format(LINE), True), (QUOTING, None, True),
                (QUOTING[:90], None, False)]

    def run(llama: Llama) -> list[list[int]]:
        handles = [submit(llama, p, f, max_new_tokens=24, temperature=0, speculative=s) for p, f, s in requests]
        return [h.result().tokens for h in handles]

    before = counters(spec)
    got = run(spec)
    assert counters(spec)[1] > before[1]
    assert got == run(plain)


@pytest.mark.slow  # (the tiny model's tests below batch and sample constrained requests quickly)
def test_a_seeded_constrained_request_gives_the_same_tokens(pair):
    """Sampled: each verified position is drawn under its mask from the request's own generator,
    one draw per position reached, as steps without proposals draw."""
    plain, spec = pair
    for kind in sorted(FORMATS):
        settings = dict(max_new_tokens=20, temperature=0.7, top_p=0.9, seed=1)
        before = counters(spec)
        got = submit(spec, PROMPTS[kind], FORMATS[kind], **settings).result()
        assert counters(spec)[1] > before[1], kind
        assert got.tokens == submit(plain, PROMPTS[kind], FORMATS[kind], **settings).result().tokens, kind


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_stop_string_inside_an_accepted_run_ends_the_reply_where_it_would(pair, alone):
    """A stop string that ends at a token given inside a run of several (its step gave tokens
    after it: the regex reply, stepped by hand) ends the constrained reply there, as without
    speculation."""
    full, inside, _, _, _ = alone["regex"]
    assert inside, "no step gave several tokens"
    i = inside[0]
    end, text = full.text_offsets[i + 1], full.text
    start = next(s for s in range(end - 1, -1, -1) if text[s:end].strip() and text.find(text[s:end]) == s)
    got, want = (submit(llama, QUOTING, TEXT, max_new_tokens=N_NEW, temperature=0, stop=(text[start:end],)).result()
                 for llama in pair)
    assert (got.tokens, got.text, got.finish_reason) == (want.tokens, want.text, "stop")
    assert got.all_tokens == full.tokens[: i + 1]  # the tokens after the stop were discarded


# -- the engine: a tiny random checkpoint, proposals replayed ------------------------------------


class Replaying:
    """Proposes what a reference run generated after the same tokens, each third proposal
    replaced by ``wrong`` (-1: none; long accepted runs, and rejections mid-run); records what it
    proposed."""

    def __init__(self, sequences: list[list[int]], wrong: int) -> None:
        self.sequences, self.wrong = sequences, wrong
        self.proposed: list[list[int]] = []

    def propose(self, tokens, k):
        for seq in self.sequences:
            if seq[: len(tokens)] == list(tokens):
                out = seq[len(tokens) : len(tokens) + k]
                out = [self.wrong if self.wrong >= 0 and (len(tokens) + j) % 3 == 0 else t for j, t in enumerate(out)]
                self.proposed.append(out)
                return out
        return []


WORDS = {"type": "regex", "regex": "[a-z ]{1,80}"}


@pytest.fixture(scope="module")
def tiny(llama3_checkpoint):
    """A tiny Llama 3 model, the grammar ``WORDS`` compiled for it, and a prompt."""
    llama = helpers.build(llama3_checkpoint, max_seq_len=64, max_batch_size=4, dtype="float32", compile=False)
    rng = random.Random(5)
    return llama, llama._grammar(WORDS), [1] + [rng.randrange(3, 250) for _ in range(8)]


def tiny_engine(llama: Llama, proposer) -> Engine:
    return steady(Engine(llama.model, llama.tokenizer, generator=torch.Generator().manual_seed(0),
                         kv_cache_tokens=96, block_size=4, speculative=NGRAM, proposer=proposer))


def fed_proposals(engine: Engine) -> list[list[int]]:
    """Record the proposals of every step the runner is given (all rows')."""
    fed: list[list[int]] = []
    run = engine.runner.run

    def recording(plan):
        fed.extend(plan.proposals.values())
        return run(plan)

    engine.runner.run = recording
    return fed


def test_a_proposal_the_grammar_forbids_is_never_verified(tiny):
    """Replayed proposals with every third a token the grammar never allows: the runner is never
    given one (the proposals are cut before it), the proposals before it are accepted, and the
    reply is the reference's."""
    llama, grammar, prompt = tiny
    settings = RequestSettings(max_new_tokens=30, temperature=0, grammar=grammar)
    want = llama.engine.submit(prompt, settings).result().tokens
    assert len(want) > 6
    forbidden = llama.tokenizer.encode("{", bos=False, eos=False)[0]
    assert forbidden not in grammar.matcher().allowed_ids()
    proposer = Replaying([prompt + want], wrong=forbidden)
    engine = tiny_engine(llama, proposer)
    # A step verifies the proposals whose masks are ready within the sampler's budget (50 ms),
    # and counts only those: on a busy machine some came late, and 15 of 17 fed proposals were
    # counted.  Late masks are the tests below; here every mask is waited for.
    engine.sampler.mask_budget_s = 5.0
    fed = fed_proposals(engine)
    got = engine.submit(prompt, settings).result().tokens
    assert got == want
    assert any(forbidden in p for p in proposer.proposed)  # proposed, and cut
    assert fed and not any(forbidden in p for p in fed)
    stats = engine.stats()
    assert stats["spec_accepted_tokens_total"] > 0
    assert stats["spec_proposed_tokens_total"] == sum(map(len, fed))


def test_masks_after_proposals_late_for_the_step_are_not_verified(tiny, monkeypatch):
    """Each mask after a proposal takes 0.6 s, far beyond the step's 50 ms: the rows verify none
    of their proposals (each draws its token at its first position, under its first mask), and
    the reply is the reference's.  (With 0.2 s a step of this tiny model on a machine at 99 %
    CPU pressure outlasted the first such mask, which was then ready and verified.)"""
    llama, grammar, prompt = tiny
    settings = RequestSettings(max_new_tokens=12, temperature=0, grammar=grammar)
    want = llama.engine.submit(prompt, settings).result().tokens
    fill_after = GrammarMasker.fill_after

    def slowed(self, matcher, tokens, out):
        for j in fill_after(self, matcher, tokens, out):
            time.sleep(0.6)
            yield j

    monkeypatch.setattr(GrammarMasker, "fill_after", slowed)
    engine = tiny_engine(llama, Replaying([prompt + want], wrong=-1))
    fed = fed_proposals(engine)
    verified: list[int] = []
    verify = engine.sampler._verify
    engine.sampler._verify = lambda i, request, logits, first, proposed, *a: (
        verified.append(len(proposed)) or verify(i, request, logits, first, proposed, *a))
    assert engine.submit(prompt, settings).result().tokens == want
    assert fed and verified and len(verified) <= len(fed)  # (a row whose first mask is late verifies none)
    assert max(verified) == 0 < min(map(len, fed))
    assert engine.stats()["spec_accepted_tokens_total"] == 0


def test_a_request_whose_masks_are_slow_proposes_nothing(tiny, monkeypatch):
    """Every mask of the grammar takes longer than the step's budget: its rows are deferred, it
    proposes nothing (each position would need one more mask), and its reply is the reference's;
    a free request beside it goes on speculating."""
    llama, grammar, prompt = tiny
    settings = RequestSettings(max_new_tokens=8, temperature=0, grammar=grammar)
    free = RequestSettings(max_new_tokens=20, temperature=0)
    want = llama.engine.submit(prompt, settings).result().tokens
    want_free = llama.engine.submit(prompt[:5], free).result().tokens
    fill = GrammarMasker.fill
    monkeypatch.setattr(GrammarMasker, "fill", lambda self, *a, **k: time.sleep(0.08) or fill(self, *a, **k))
    engine = tiny_engine(llama, Replaying([prompt + want, prompt[:5] + want_free], wrong=-1))
    engine.sampler.mask_budget_s = 0.02
    plans: list[dict[int, list[int]]] = []
    run = engine.runner.run
    engine.runner.run = lambda plan: plans.append(dict(plan.proposals)) or run(plan)
    slow, other = engine.submit(prompt, settings), engine.submit(prompt[:5], free)
    assert slow.result().tokens == want and other.result().tokens == want_free
    assert not any(slow.id in p for p in plans) and any(other.id in p for p in plans)


def test_masks_around_the_budget_change_when_tokens_come_never_which(tiny, monkeypatch):
    """Three seeded constrained requests and a free one, all proposing (replayed references),
    their grammars' masks delayed around a 10 ms budget (first masks late and deferred, masks
    after proposals cut, slow requests that stop proposing): each gets the tokens it gets
    without speculation, and proposals are accepted."""
    llama, grammar, prompt = tiny
    formats = [json_schema_format({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
               {"type": "regex", "regex": "(yes|no|maybe)[.!]"}]
    grammars = [grammar] + [llama._grammar(f) for f in formats]
    settings = [RequestSettings(max_new_tokens=14, temperature=1.0, seed=s, grammar=g)
                for s, g in zip((1, 2, 3), grammars)] + [RequestSettings(max_new_tokens=14, temperature=0)]

    def run(engine: Engine) -> list[list[int]]:
        handles = [engine.submit(prompt, s) for s in settings]
        return [h.result().tokens for h in handles]

    expected = run(llama.engine)
    engine = tiny_engine(llama, Replaying([prompt + e for e in expected], wrong=-1))
    engine.sampler.mask_budget_s = 0.01
    helpers.delay_masks(monkeypatch, engine.sampler, {id(g): d for g, d in zip(grammars, (0.0, 0.004, 0.03))})
    released: list[int] = []
    take_held = engine.sampler.take_held
    engine.sampler.take_held = lambda *a: released.append(len((out := take_held(*a))[0])) or out
    assert run(engine) == expected
    assert sum(released), "no row was deferred"
    assert engine.stats()["spec_accepted_tokens_total"] > 0


def test_a_row_whose_first_mask_is_late_verifies_nothing_and_gives_its_blocks_back(tiny, monkeypatch):
    """The first mask of a step that verifies proposals is late (0.3 s, beyond a 20 ms budget):
    the row is deferred as without proposals (it verifies none and waits for its mask), the
    blocks taken for its proposals go back at once, and the reply is the reference's."""
    llama, grammar, prompt = tiny
    settings = RequestSettings(max_new_tokens=20, temperature=0, grammar=grammar)
    want = llama.engine.submit(prompt, settings).result().tokens
    engine = tiny_engine(llama, Replaying([prompt + want], wrong=-1))
    engine.sampler.mask_budget_s = 0.02
    state = {"proposing": False, "masks": 0, "delayed": 0}
    start_masks = engine.sampler.start_masks

    def starting(requests, proposals=None):
        state["proposing"], state["masks"] = bool(proposals), 0
        start_masks(requests, proposals)

    fill = GrammarMasker.fill

    def slowed(self, matchers, **kw):
        state["masks"] += 1
        if state["proposing"] and state["masks"] == 1 and not state["delayed"]:  # the step's first mask
            state["delayed"] += 1
            time.sleep(0.3)
        return fill(self, matchers, **kw)

    engine.sampler.start_masks = starting
    monkeypatch.setattr(GrammarMasker, "fill", slowed)
    handle = engine.submit(prompt, settings)
    waited = 0
    while not handle.finished:
        engine.step()
        for request in engine.scheduler.running.values():
            if not request.prefilling:
                assert engine.kv.held(request.id) <= engine.kv.blocks.blocks_for(request.n_fed + 1)
                waited += request.pending is None  # deferred: its next token not chosen yet
    assert handle.result().tokens == want
    assert state["delayed"] and waited
    assert engine.stats()["spec_accepted_tokens_total"] > 0
    engine.kv.blocks.check([])
    assert engine.kv.blocks.available == engine.kv.blocks.usable


# -- tool calls --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_pair(llama3_checkpoint):
    options = dict(max_seq_len=4096, max_batch_size=2, dtype="float32", compile=False)
    spec = helpers.build(llama3_checkpoint, speculative=NGRAM, **options)
    steady(spec.engine)
    return helpers.build(llama3_checkpoint, **options), spec


@pytest.mark.slow  # long prompts (the tools' declarations)
def test_tool_calls_forced_and_auto_are_the_same(tool_pair):
    """Forced calls (``tool_choice`` "required", seeded, and a named function, greedy: grammars)
    and ``"auto"`` (free text, read for calls afterwards): the same replies, calls and all, with
    proposals accepted in the forced ones."""
    from test_tool_choice import BOUNDED, DIALOG

    plain, spec = tool_pair
    accepted = {}
    for choice, temperature, seed in (("required", 1.0, 4), ({"type": "function", "function": {"name": "get_weather"}},
                                                             0.0, None), ("auto", 1.0, 4)):
        before = counters(spec)[1]
        kwargs = dict(temperature=temperature, top_p=1.0, max_gen_len=100, seed=seed, tools=BOUNDED,
                      tool_choice=choice)
        (got,) = spec.chat_completion([DIALOG], **kwargs)
        (want,) = plain.chat_completion([DIALOG], **kwargs)
        for call in got["generation"].get("tool_calls", []) + want["generation"].get("tool_calls", []):
            call.pop("call_id")  # drawn at random for each reply
        assert got == want, choice
        accepted[repr(choice)] = counters(spec)[1] - before
    # the forced calls quote the tools' schemas, declared in the prompt: proposals are accepted
    forced = [n for choice, n in accepted.items() if choice != repr("auto")]
    assert len(forced) == 2 and all(forced), accepted
