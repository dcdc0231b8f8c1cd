"""Speculative decoding with a draft model (llama.engine.draft): a smaller model proposes, the
target verifies, and what comes out is what comes out without it.

References: the demo model without speculation (greedy tokens, log-probabilities, stop strings,
batches); the target as its own draft, where every greedy proposal must be accepted (the two
caches' positions agree) and sampled ones nearly all (the draft's q is the request's own
distribution); the first two layers of the demo as a draft that is right now and then; the
draft's own pool checked against its tables after every step, and empty once requests finish,
are cancelled or preempted; one process against two under torchrun.  The distribution of
sampled runs is tested in tests/test_speculative.py (a draft's q that is not the target's)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import helpers
from llama import Llama
from llama.engine import Engine, RequestSettings
from llama.engine.draft import DraftProposer, check_same_tokenizer, tokenizer_difference
from llama.engine.sampling import SamplingParams
from llama.tokenizer import load_tokenizer
from test_speculative import (
    LOOP,
    PLAIN,
    QUOTING,
    counters,
    inside_a_run,
    reference,
    run,
    run_structure,
    steady,
    tiny_prompt,
    token_events,
)

DEMO = helpers.REPO / "demo"
N_NEW = 40


def demo(**kw) -> Llama:
    llama = Llama.build(DEMO, DEMO / "tokenizer.model", max_seq_len=256, max_batch_size=4, device="cpu",
                        dtype="float32", compile=False, **kw)
    steady(llama.engine)
    return llama


def drafting(draft_dir, num_tokens: int = 4, **options) -> dict:
    return {"method": "draft", "draft_ckpt_dir": str(draft_dir), "num_tokens": num_tokens, **options}


def truncated_demo(out: Path, n_layers: int, **params) -> Path:
    """The demo's first ``n_layers`` layers (and its embedding, norm and output) as a checkpoint of
    its own, with the demo's tokenizer: a draft trained on the same text, right now and then."""
    import json

    weights = torch.load(DEMO / "consolidated.00.pth", weights_only=True)
    kept = {k: v for k, v in weights.items() if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers}
    out.mkdir(parents=True)
    (out / "params.json").write_text(json.dumps({**json.loads((DEMO / "params.json").read_text()),
                                                 "n_layers": n_layers, **params}))
    torch.save(kept, out / "consolidated.00.pth")
    shutil.copy(DEMO / "tokenizer.model", out / "tokenizer.model")
    return out


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return truncated_demo(tmp_path_factory.mktemp("draft") / "two-layers", 2)


class Built(dict):
    """Models built when first asked for."""

    def __init__(self, makers: dict) -> None:
        super().__init__()
        self.makers = makers

    def __missing__(self, key: str) -> Llama:
        self[key] = built = self.makers[key]()
        return built


@pytest.fixture(scope="module")
def models(draft_dir):
    """The demo without speculation, and with its first two layers as draft, with fixed costs
    (``adaptive`` off: what it proposes depends on the request alone, so that a sampled request's
    text for a seed is the same in every run; the measured rule with a draft is tested in the
    torchrun job below and with made-up times in tests/test_speculative.py)."""
    return Built({"plain": demo, "draft": lambda: demo(speculative=drafting(draft_dir, adaptive=False))})


@pytest.fixture(scope="module")
def reference_reply(models):
    events: list = []
    plain = models["plain"]
    tokens = plain.tokenizer.encode(QUOTING, bos=True, eos=False)
    handle = plain.engine.submit(tokens, RequestSettings(max_new_tokens=N_NEW, temperature=0, logprobs=True,
                                                         top_logprobs=3), on_event=events.append)
    return handle.result(), token_events(events)


@pytest.fixture(scope="module")
def drafted_reply(models):
    """The 2-layer draft's engine's reply to QUOTING, stepped by hand: tokens, tokens per step, events."""
    spec = models["draft"]
    before = counters(spec)
    prompt = spec.tokenizer.encode(QUOTING, bos=True, eos=False)
    out = run_structure(spec.engine, prompt, max_new_tokens=N_NEW, temperature=0, logprobs=True, top_logprobs=3)
    proposed, accepted = (a - b for a, b in zip(counters(spec), before))
    assert 0 < accepted < proposed, (accepted, proposed)  # the draft is right, and wrong
    spec.engine.draft.check()
    return out


# -- greedy: the tokens without speculation ------------------------------------------------------


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_greedy_tokens_are_the_same_alone(models, reference_reply, drafted_reply):
    assert drafted_reply[0] == reference_reply[0].tokens
    assert max(drafted_reply[1]) > 1  # steps gave several tokens
    assert run(models["draft"], [PLAIN], max_new_tokens=20, temperature=0)[0].tokens == \
        run(models["plain"], [PLAIN], max_new_tokens=20, temperature=0)[0].tokens


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_the_target_as_its_own_draft_has_every_proposal_accepted(llama3_checkpoint):
    """Its own draft proposes the target's own argmax tokens: every one is accepted, alone and
    batched (the draft's cache positions are the target's, step after step).  The tiny random
    model, its prompts fed 5 tokens a step, with fixed costs (a draft as dear as its target pays
    little, and measured times could stop it)."""
    engine = tiny_drafting_engine(llama3_checkpoint, adaptive=False)
    prompt = tiny_prompt(5, 9)
    tokens, steps, _ = run_structure(engine, prompt, max_new_tokens=24, temperature=0)
    assert tokens == reference(llama3_checkpoint, prompt, 24)
    assert max(steps) == 5  # the pending token's and 4 accepted proposals
    prompts = [tiny_prompt(6, 7), tiny_prompt(7, 12)]
    handles = [engine.submit(p, RequestSettings(max_new_tokens=16, temperature=0)) for p in prompts]
    assert [h.result().tokens for h in handles] == [reference(llama3_checkpoint, p, 16) for p in prompts]
    proposed, accepted = engine.stats()["spec_proposed_tokens_total"], engine.stats()["spec_accepted_tokens_total"]
    assert proposed == accepted > 0
    check_draft_books(engine)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_greedy_tokens_are_the_same_batched_with_requests_that_do_not_speculate(models):
    spec = models["draft"]
    prompts = [QUOTING, PLAIN, QUOTING[:80], LOOP]
    before = counters(spec)
    handles = [spec.engine.submit(spec.tokenizer.encode(p, bos=True, eos=False),
                                  RequestSettings(max_new_tokens=32, temperature=0, speculative=i != 1))
               for i, p in enumerate(prompts)]
    assert [h.result().tokens for h in handles] == \
        [r.tokens for r in run(models["plain"], prompts, max_new_tokens=32, temperature=0)]
    assert counters(spec)[1] > before[1]
    assert spec.engine.draft.blocks.in_use == 0  # every request gave its draft blocks back


def test_log_probabilities_are_the_target_s(reference_reply, drafted_reply):
    got, (result, want) = token_events(drafted_reply[2]), reference_reply
    assert [e.logprob for e in got] == pytest.approx(result.logprobs, abs=1e-4)
    for a, b in zip(got, want):
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def test_a_stop_string_inside_a_run_ends_the_reply_where_it_would(models, reference_reply, drafted_reply):
    full = reference_reply[0]
    i = inside_a_run(drafted_reply[1])[0]  # a token given with more after it in the same step
    end, text = full.text_offsets[i + 1], full.text
    start = next(s for s in range(end - 1, -1, -1) if text[s:end].strip() and text.find(text[s:end]) == s)
    got, want = (run(models[k], [QUOTING], max_new_tokens=N_NEW, temperature=0, stop=(text[start:end],))[0]
                 for k in ("draft", "plain"))
    assert (got.tokens, got.text, got.finish_reason) == (want.tokens, want.text, "stop")
    assert got.all_tokens == full.tokens[: i + 1]


# -- sampled: the draft's own distribution ---------------------------------------------------------


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_sampled_requests_draw_their_proposals_from_the_request_s_distribution(llama3_checkpoint):
    """The target as its own draft, sampled (temperature, top-p): the draft's q is the target's p
    (the request's settings applied to the same logits), so nearly every proposal is accepted
    (the tiny random model drafting for itself)."""
    engine = tiny_drafting_engine(llama3_checkpoint, adaptive=False)
    settings = RequestSettings(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7, stop_tokens=frozenset())
    handles = [engine.submit(tiny_prompt(seed, 9), settings) for seed in (8, 9)]
    assert all(len(h.result().tokens) == 24 for h in handles)
    proposed, accepted = engine.stats()["spec_proposed_tokens_total"], engine.stats()["spec_accepted_tokens_total"]
    assert proposed >= 12 and accepted >= 0.9 * proposed, (accepted, proposed)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_seed_gives_the_same_text_again_with_a_draft_that_is_often_wrong(models):
    """Draws of the draft's own, rejections, resampling: with the same settings (fixed costs:
    ``adaptive`` off) a seed gives the same text again."""
    settings = dict(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    spec = models["draft"]
    before = counters(spec)
    again = [run(spec, [LOOP], **settings)[0].tokens for _ in range(2)]
    assert again[0] == again[1]
    proposed, accepted = (a - b for a, b in zip(counters(spec), before))
    assert 0 < accepted < proposed, (accepted, proposed)


# -- the draft's tokenizer and vocabulary -----------------------------------------------------------


def test_a_draft_with_another_tokenizer_is_refused_before_loading(draft_dir, tmp_path, sp_tokenizer_path):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(draft_dir, other)
    shutil.copy(sp_tokenizer_path, other / "tokenizer.model")
    with pytest.raises(ValueError) as e:
        demo(speculative=drafting(other))
    message = str(e.value)
    assert str(other / "tokenizer.model") in message and str(DEMO / "tokenizer.model") in message
    assert "n_words differs (400 against 4096)" in message


def test_building_with_a_draft_reads_the_target_s_tokenizer_once(draft_dir, monkeypatch):
    """Each read of a Llama 3 or 4 tokenizer takes 0.3-1 s.  A build with a draft model reads the
    target's tokenizer once (to compare it with the draft's before any weight is read), and neither
    model's loading reads its tokenizer again: it was read five times before, the draft's three.
    (The draft's is still read twice: before the target's weights, and beside the draft's.)"""
    from llama.checkpoint import loader
    from llama.engine import build

    reads: list[Path] = []

    def counting(path):
        reads.append(Path(path).resolve())
        return load_tokenizer(path)

    monkeypatch.setattr(build, "load_tokenizer", counting)
    monkeypatch.setattr(loader, "load_tokenizer", counting)
    llama = Llama.build(DEMO, DEMO / "tokenizer.model", max_seq_len=64, max_batch_size=1, device="cpu",
                        dtype="float32", compile=False, speculative=drafting(draft_dir))
    assert llama.engine.draft is not None
    target, draft = (DEMO / "tokenizer.model").resolve(), (draft_dir / "tokenizer.model").resolve()
    assert reads.count(target) == 1, reads
    assert reads.count(draft) == 2, reads
    assert len(reads) == 3, reads

def test_tokenizers_that_differ_in_one_token_are_told_apart(tiny_tiktoken_path, tmp_path):
    lines = tiny_tiktoken_path.read_text().splitlines()
    (tmp_path / "same").mkdir()
    (tmp_path / "same" / "tokenizer.model").write_text("\n".join(lines) + "\n")
    swapped = list(lines)
    (a, ra), (b, rb) = (line.split() for line in swapped[300 - 2 :])
    swapped[-2:] = [f"{b} {ra}", f"{a} {rb}"]  # the last two base tokens trade ids
    (tmp_path / "swapped").mkdir()
    (tmp_path / "swapped" / "tokenizer.model").write_text("\n".join(swapped) + "\n")
    target = load_tokenizer(tiny_tiktoken_path)
    assert tokenizer_difference(load_tokenizer(tmp_path / "same" / "tokenizer.model"), target) is None
    with pytest.raises(ValueError, match=r"token 298 differs"):
        check_same_tokenizer(load_tokenizer(tmp_path / "swapped" / "tokenizer.model"), target)


def test_a_draft_with_another_vocab_size_is_refused(tmp_path):
    draft = tmp_path / "padded"
    params = dict(dim=64, n_layers=1, n_heads=4, multiple_of=32, norm_eps=1e-5, vocab_size=4096 + 64)
    helpers.write_checkpoint(draft, params, helpers.random_weights(params, 4096 + 64))
    shutil.copy(DEMO / "tokenizer.model", draft / "tokenizer.model")
    with pytest.raises(ValueError, match=r"has vocab_size 4160, the target 4096"):
        demo(speculative=drafting(draft))


def test_a_draft_sharded_otherwise_than_the_target_is_refused(draft_dir):
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2 is not supported with 1 process"):
        demo(speculative={**drafting(draft_dir), "draft_tensor_parallel_size": 2})


def test_the_engine_refuses_a_draft_it_cannot_use(llama3_checkpoint):
    """(kv_cache_memory with a draft, refused before it counted the draft's pool, is tested in
    tests/test_kv_cache_memory.py.)"""
    llama = helpers.build(llama3_checkpoint, dtype="float32", compile=False)
    options = dict(generator=torch.Generator(), speculative=drafting("-"))
    with pytest.raises(ValueError, match="needs the draft model"):
        Engine(llama.model, llama.tokenizer, **options)


# -- the draft's blocks ------------------------------------------------------------------------------


def tiny_drafting_engine(checkpoint, adaptive: bool = True, **kw) -> Engine:
    """The tiny random model drafting for itself (every greedy proposal right) over small pools,
    prompts fed in chunks of 5."""
    llama = helpers.build(checkpoint, max_seq_len=64, max_batch_size=4, dtype="float32", compile=False)
    options = {"kv_cache_tokens": 96, "block_size": 4, "prefill_chunk": 5, **kw}
    return steady(Engine(llama.model, llama.tokenizer, generator=torch.Generator().manual_seed(0),
                         speculative=drafting("-", adaptive=adaptive), draft=llama.model, **options))


def check_draft_books(engine: Engine) -> None:
    """The draft's pool agrees with its tables; only running requests hold draft blocks, none
    more than its tokens and proposals take."""
    draft = engine.draft
    assert draft is not None
    draft.check()
    for request in engine.scheduler.preempted:
        assert draft.held(request.id) == 0
    for request in engine.scheduler.running.values():
        assert draft.held(request.id) <= draft.blocks.blocks_for(len(request.tokens_so_far()) + 4)
    held = sum(draft.held(r.id) for r in engine.scheduler.running.values())
    assert draft.blocks.in_use == held


class Fake:
    """What the draft proposer reads of a request."""

    def __init__(self, request_id: int, tokens: list[int]) -> None:
        self.id, self.tokens = request_id, tokens
        self.sampling, self.generator = SamplingParams(temperature=0), None
        self.settings = RequestSettings(max_new_tokens=1)

    def tokens_so_far(self) -> list[int]:
        return list(self.tokens)


def tiny_proposer(checkpoint, tokens: int = 96) -> DraftProposer:
    llama = helpers.build(checkpoint, max_seq_len=64, max_batch_size=4, dtype="float32", compile=False)
    return DraftProposer(llama.model, n_blocks=1 + tokens // 4, block_size=4, n_decodable=llama.tokenizer.n_words,
                         prefill_chunk=5)


def test_draft_proposals_are_the_draft_model_s_own_greedy_tokens(llama3_checkpoint):
    """The proposer's tokens are what the draft model generates greedily after the same tokens
    (an engine without speculation): on first use (its prompt fed in chunks of 5), after some of
    its proposals were kept and another token followed them (its cache rolled back), and for rows
    of different lengths together."""
    proposer = tiny_proposer(llama3_checkpoint)
    prompt = tiny_prompt(7, 9)
    ref = reference(llama3_checkpoint, prompt, 12)
    out, probs = proposer.propose_rows([(Fake(0, prompt + ref[:1]), 4)])
    assert out == {0: ref[1:5]} and probs == {}
    assert proposer.fed(0) == len(prompt) + 1 + 3  # its tokens and 3 proposals (not the last)
    other = next(t for t in range(3, 250) if t != ref[3])
    seq = prompt + ref[:3] + [other]  # two proposals kept, then another token
    out, _ = proposer.propose_rows([(Fake(0, seq), 3)])
    assert out == {0: reference(llama3_checkpoint, seq, 3)}
    first, second = seq + out[0][:1], tiny_prompt(8, 14)  # one kept, and another request
    out, _ = proposer.propose_rows([(Fake(0, first), 2), (Fake(1, second), 4)])
    assert out == {0: reference(llama3_checkpoint, first, 2), 1: reference(llama3_checkpoint, second, 4)}
    proposer.check()
    proposer.release(0)
    proposer.release(1)
    assert proposer.blocks.in_use == 0


def test_a_short_draft_pool_takes_the_blocks_of_requests_that_do_not_propose(llama3_checkpoint):
    proposer = tiny_proposer(llama3_checkpoint, tokens=24)  # 6 blocks of 4
    a, b = Fake(0, tiny_prompt(1, 9)), Fake(1, tiny_prompt(2, 14))
    assert 0 in proposer.propose_rows([(a, 4)])[0]  # 9 + 3 tokens: 3 blocks
    out, _ = proposer.propose_rows([(a, 4), (b, 4)])  # b needs 5 more: it proposes nothing
    assert 0 in out and 1 not in out and proposer.held(0) == 3
    proposer.check()
    out, _ = proposer.propose_rows([(b, 4)])  # a proposes nothing now: its blocks go to b
    assert out == {1: reference(llama3_checkpoint, b.tokens, 4)}
    assert proposer.held(0) == 0 and proposer.held(1) == 5
    proposer.check()


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_draft_blocks_go_back_when_requests_finish_or_are_cancelled(llama3_checkpoint):
    engine = tiny_drafting_engine(llama3_checkpoint)
    prompts = [tiny_prompt(60 + i, 9) for i in range(3)]
    handles = [engine.submit(p, RequestSettings(max_new_tokens=20, temperature=0)) for p in prompts]
    victim = handles[1]
    for _ in range(12):  # until it proposed (the prompts are prefilled 5 tokens a step)
        engine.step()
        check_draft_books(engine)
        if engine.draft.held(victim.id):
            break
    assert engine.draft.held(victim.id) > 0 and not victim.finished
    victim.cancel()
    while not all(h.finished for h in handles):
        engine.step()
        check_draft_books(engine)
        assert engine.draft.held(victim.id) == 0
    assert handles[0].result().tokens == reference(llama3_checkpoint, prompts[0], 20)
    assert handles[1].result().finish_reason == "cancelled"
    assert engine.stats()["spec_accepted_tokens_total"] == engine.stats()["spec_proposed_tokens_total"] > 0
    assert engine.draft.blocks.in_use == 0
    engine.draft.blocks.check([])


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_draft_blocks_go_back_when_requests_are_preempted(llama3_checkpoint):
    """Four drafting requests in a pool too small for them: preempted requests hold no draft
    block, resumed ones catch up from nothing, and each gets the reference's tokens."""
    prompts = [tiny_prompt(40 + i, 10 + 3 * i) for i in range(4)]
    refs = [reference(llama3_checkpoint, p, 24) for p in prompts]
    engine = tiny_drafting_engine(llama3_checkpoint, kv_cache_tokens=64)
    handles = [engine.submit(p, RequestSettings(max_new_tokens=24, temperature=0)) for p in prompts]
    while not all(h.finished for h in handles):
        engine.step()
        check_draft_books(engine)
    assert engine.stats()["preemptions_total"] > 0 and engine.stats()["spec_accepted_tokens_total"] > 0
    assert [h.result().tokens for h in handles] == refs
    assert engine.draft.blocks.in_use == 0


# -- ranks -----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess  # a torchrun job (helpers.torchrun: at most 300 s)
def test_two_ranks_give_the_tokens_of_one(llama2_checkpoint, sp_tokenizer_path, tmp_path):
    """Two gloo ranks, the target sharded over them, speculating in one job with three engines in
    turn: by prompt lookup (test_speculative.py's two-rank test, which had a job of its own), then
    with the target's one-layer cut as draft, whole on each rank, then sharded as the target.
    Each gives the tokens of one process (greedy, seeded samples, a processor, served; prompt
    lookup a grammar too, each rank proposing the same from the same tokens, a constrained
    request's cut by the first rank's grammar and shared), the same proposals; and one process
    gives the tokens it gives without speculation."""
    from spec_worker import SPECULATIVE, workload

    ckpt1, tok, params, weights = llama2_checkpoint
    ckpt2 = helpers.write_checkpoint(tmp_path / "ckpt2", params, weights, n_shards=2, embedding_layout="dim")
    draft_weights = {k: v for k, v in weights.items() if not k.startswith("layers.1.")}
    draft = helpers.write_checkpoint(tmp_path / "draft", {**params, "n_layers": 1}, draft_weights, 1, "dim")
    shutil.copy(sp_tokenizer_path, draft / "tokenizer.model")
    options = dict(max_seq_len=64, max_batch_size=3, device="cpu", dtype="float32")
    plain = workload(Llama.build(ckpt1, tok, **options))
    assert plain["proposed"] == 0
    ngram = workload(Llama.build(ckpt1, tok, speculative=SPECULATIVE, **options))
    for key in ("greedy", "sampled", "processed", "constrained", "served"):
        assert ngram[key] == plain[key], ("ngram", key)
    assert ngram["accepted"] > 0 and ngram["constrained_proposed"] > 0
    single = workload(Llama.build(ckpt1, tok, speculative=drafting(draft, 3), **options))
    for key in ("greedy", "processed", "served"):
        assert single[key] == plain[key], ("draft", key)
    assert single["accepted"] > 0
    out = tmp_path / "out"
    out.mkdir()
    proc = helpers.torchrun(Path(__file__).parent / "spec_worker.py",
                            [str(ckpt2), str(tok), str(out), str(draft), "ngram,0,1"], nproc=2)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]  # prompt lookup
    for r in results:
        for key in ("greedy", "sampled", "processed", "constrained", "constrained_proposed", "proposed", "accepted"):
            assert r[key] == ngram[key], ("ngram", key)
    assert results[0]["served"] == ngram["served"] and results[1]["served"] is None
    assert results[0]["proposed_all"] == results[1]["proposed_all"]  # served too: every rank alike
    for layout in ("0", "1"):  # the draft whole, sharded
        results = [torch.load(out / f"rank{r}-{layout}.pt", weights_only=False) for r in range(2)]
        for r in results:
            for key in ("greedy", "sampled", "processed", "proposed", "accepted"):
                assert r[key] == single[key], (layout, key)
        assert results[0]["served"] == single["served"] and results[1]["served"] is None
        assert results[0]["proposed_all"] == results[1]["proposed_all"]  # served too: every rank alike
