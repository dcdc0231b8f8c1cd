"""Constrained decoding through the engine and the Python API (``response_format=``): random-weight
checkpoints of the Llama 3 (tiktoken) and Llama 2 (SentencePiece) families sampled at temperature
1.0 over several seeds, so that only the constraint can make a reply valid; replies checked by
independent means (``json``, ``jsonschema``, ``re.fullmatch``)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from helpers import build
from test_grammar import REGEXES, SCHEMAS, json_schema_format

SEEDS = range(3)
# Bounded schemas end within this many tokens (each place of a JSON text allows a bounded run of whitespace).
ROOM = 400


# One model of each family for the module (tests that need other weights or sizes build their own).
@pytest.fixture(scope="module")
def llama3(llama3_checkpoint):
    return build(llama3_checkpoint, max_seq_len=512, max_batch_size=4)


@pytest.fixture(scope="module")
def llama2(llama2_checkpoint):
    return build(llama2_checkpoint, max_seq_len=512, max_batch_size=4)


@pytest.fixture(params=["llama3", "llama2"])
def llama(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_sampled_replies_validate_against_their_schema(llama, name):
    schema = SCHEMAS[name]
    for seed in SEEDS:
        (out,) = llama.text_completion(["the"], temperature=1.0, top_p=1.0, max_gen_len=ROOM, seed=seed,
                                       response_format=json_schema_format(schema))
        jsonschema.validate(json.loads(out["generation"]), schema)


@pytest.mark.parametrize("regex", REGEXES)
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_sampled_replies_match_their_regex(llama, regex):
    for seed in SEEDS:
        (out,) = llama.text_completion(["the"], temperature=1.0, top_p=1.0, max_gen_len=ROOM, seed=seed,
                                       response_format={"type": "regex", "regex": regex})
        assert re.fullmatch(regex, out["generation"]), out


def test_a_chat_reply_is_the_constrained_text_as_content(llama3):
    llama = llama3
    dialog = [{"role": "user", "content": "a color please"}]
    schema = SCHEMAS["enum_and_array"]
    (reply,) = llama.chat_completion([dialog], temperature=1.0, max_gen_len=ROOM, seed=3,
                                     response_format=json_schema_format(schema))
    message = reply["generation"]
    jsonschema.validate(json.loads(message["content"]), schema)
    assert message["stop_reason"] == "end_of_turn" and not message.get("tool_calls")


def test_constrained_and_free_requests_share_a_batch(llama3):
    """In one batch, each request gets what it gets alone: greedy tokens identical."""
    llama = llama3
    fmt = {"type": "regex", "regex": REGEXES[0]}
    prompts = ["the cat", "Hello", "the"]
    alone = [llama.text_completion([prompts[0]], temperature=0, max_gen_len=40)[0],
             llama.text_completion([prompts[1]], temperature=0, max_gen_len=40, response_format=fmt)[0],
             llama.text_completion([prompts[2]], temperature=0, max_gen_len=40)[0]]
    engine = llama.engine
    from llama.engine import RequestSettings

    grammar = llama._grammar(fmt)
    settings = [RequestSettings(max_new_tokens=40, temperature=0),
                RequestSettings(max_new_tokens=40, temperature=0, grammar=grammar),
                RequestSettings(max_new_tokens=40, temperature=0)]
    handles = [engine.submit(llama.tokenizer.encode(p, bos=True, eos=False), s) for p, s in zip(prompts, settings)]
    together = [h.result().text for h in handles]
    assert together == [a["generation"] for a in alone]
    assert re.fullmatch(REGEXES[0], together[1])


def test_a_stream_gives_the_text_of_the_call(llama3):
    llama = llama3
    fmt = json_schema_format(SCHEMAS["integers"])
    (whole,) = llama.text_completion(["the"], temperature=1.0, max_gen_len=ROOM, seed=7, response_format=fmt)
    pieces = "".join(llama.text_completion_stream("the", temperature=1.0, max_gen_len=ROOM, seed=7,
                                                  response_format=fmt))
    assert pieces == whole["generation"]
    jsonschema.validate(json.loads(pieces), SCHEMAS["integers"])


def test_a_reply_cut_by_max_gen_len_ends_for_length(llama3):
    llama = llama3
    from llama.engine import RequestSettings

    grammar = llama._grammar(json_schema_format(SCHEMAS["nested"]))
    result = llama.engine.submit(llama.tokenizer.encode("the", bos=True, eos=False),
                                 RequestSettings(max_new_tokens=3, temperature=1.0, seed=1, grammar=grammar)).result()
    assert result.finish_reason == "length" and len(result.tokens) == 3 and result.text.startswith("{")


def test_log_probabilities_are_those_of_the_masked_distribution(llama3):
    """A constrained token's log-probability is the model's, renormalised over the tokens the
    grammar allows at that step: log p(t) - logsumexp(log p(allowed))."""
    import torch

    llama = llama3
    fmt = {"type": "regex", "regex": "(yes|no|maybe)"}
    prompt = llama.tokenizer.encode("the", bos=True, eos=False)
    (constrained,) = llama.text_completion(["the"], temperature=0, max_gen_len=6, logprobs=True, response_format=fmt)
    assert constrained["generation"] in ("yes", "no", "maybe")
    free = torch.log_softmax(llama.model.forward(torch.tensor([prompt]), 0)[0, -1], dim=-1)
    allowed = llama._grammar(fmt).matcher().allowed_ids()
    first = [t for t in allowed if constrained["tokens"][0] == llama.tokenizer.decode([t])][0]
    expected = free[first] - torch.logsumexp(free[allowed], dim=0)
    assert constrained["logprobs"][0] == pytest.approx(float(expected), abs=1e-5)
    assert constrained["logprobs"][0] > float(free[first])  # the mass of the masked tokens moved to the allowed


@pytest.mark.parametrize("response_format", [{"type": "regex", "regex": "(yes|no|maybe)"},
                                             json_schema_format(SCHEMAS["enum_and_array"])])
def test_alternatives_are_the_tokens_the_grammar_allows(llama3, response_format):
    """top_logprobs of a constrained reply list only tokens its grammar allows at that step, all
    of them where it allows fewer than asked, with finite log-probabilities: the masked
    distribution's most likely tokens.  At the first step they equal an independent
    computation: the model's log-probabilities renormalised over the allowed ids, sorted.
    (Before, the masked tokens filled the list with -inf.)"""
    import math

    import torch

    from llama.engine import RequestSettings

    llama = llama3
    k = 20
    grammar = llama._grammar(response_format)
    prompt = llama.tokenizer.encode("the", bos=True, eos=False)
    free = torch.log_softmax(llama.model.forward(torch.tensor([prompt]), 0)[0, -1].float(), dim=-1)
    for seed in range(3):
        settings = RequestSettings(max_new_tokens=60, temperature=1.0, top_p=1.0, seed=seed, logprobs=True,
                                   top_logprobs=k, grammar=grammar)
        matcher = grammar.matcher(llama.engine.grammar_end_ids(settings))  # the request's, replayed
        events = [ev for ev in llama.engine.submit(prompt, settings).events() if ev.token is not None]
        assert events
        for step, ev in enumerate(events):
            allowed = matcher.allowed_ids()
            ids = [t for t, _ in ev.top_logprobs]
            values = [v for _, v in ev.top_logprobs]
            assert all(math.isfinite(v) for v in values + [ev.logprob]), ev
            assert set(ids) <= set(allowed), (step, sorted(set(ids) - set(allowed)))
            assert len(ids) == min(k, len(allowed)) and values == sorted(values, reverse=True)
            if step == 0:
                renormalised = free[allowed] - torch.logsumexp(free[allowed], dim=0)
                expected = sorted(zip(renormalised.tolist(), allowed), reverse=True)[:k]
                assert ids == [t for _, t in expected]
                assert values == pytest.approx([v for v, _ in expected], abs=1e-5)
            matcher.consume(ev.token)


@pytest.mark.parametrize("bad, field", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, "response_format.json_schema"),
    ({"type": "regex", "regex": "(unclosed"}, "response_format.regex"),
    ({"type": "xml"}, "response_format.type"),
])
def test_a_format_that_cannot_be_compiled_is_refused_before_generating(llama3, bad, field):
    llama = llama3
    before = llama.engine.stats()["requests_total"]
    with pytest.raises(ValueError, match=re.escape(field)):
        llama.text_completion(["the"], max_gen_len=5, response_format=bad)
    assert llama.engine.stats()["requests_total"] == before  # none was submitted


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_json_object_always_gives_an_object(llama3_checkpoint, llama2_checkpoint):
    """Any object, however long its strings: sampled at temperature 1 the replies of both
    families end, each a JSON object (a reply would be cut only by max_gen_len)."""
    for checkpoint in (llama3_checkpoint, llama2_checkpoint):
        llama = build(checkpoint, max_seq_len=3100, max_batch_size=3)
        outs = [llama.text_completion(["the"], temperature=1.0, top_p=1.0, max_gen_len=3000, seed=seed,
                                      response_format={"type": "json_object"})[0]["generation"] for seed in range(4)]
        for out in outs:
            assert isinstance(json.loads(out), dict), out


ANY_TEXT = [{"type": "regex", "regex": "(?s:.*)"}, {"type": "grammar", "grammar": "start: /(.|\\n)*/"}]


def first_invalid_utf8(tokenizer, ids: list[int]) -> int:
    """How many of ``ids`` make a start of valid UTF-8 text (all of them if they do)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    for k, i in enumerate(ids):
        try:
            decoder.decode(tokenizer.model.decode_single_token_bytes(i))
        except UnicodeDecodeError:
            return k
    return len(ids)


def is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("response_format", ANY_TEXT)
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_grammar_that_accepts_everything_leaves_greedy_text_alone(tmp_path, llama3_checkpoint, response_format):
    """A grammar that accepts any text changes nothing for a model that writes text: greedy
    tokens identical.  (The checkpoint's output rows of control tokens and of tokens that are not
    whole UTF-8 characters are zeroed, so that its greedy choices are text.)"""
    import helpers
    from llama.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(llama3_checkpoint.tokenizer_path)
    weights = {k: v.clone() for k, v in llama3_checkpoint.weights.items()}
    not_text = [i for i in range(tokenizer.n_words)
                if i in tokenizer.special_tokens.values() or not is_utf8(tokenizer.model.decode_single_token_bytes(i))]
    weights["output.weight"][not_text] = 0.0
    ckpt = helpers.write_checkpoint(tmp_path, llama3_checkpoint.params, weights, 1, "vocab")
    llama = build(helpers.Checkpoint(ckpt, llama3_checkpoint.tokenizer_path, llama3_checkpoint.params, weights),
                  max_seq_len=256)
    for prompt in ["the", "Hello", "a b c", "zz", "1 2"]:
        free = llama.text_completion([prompt], temperature=0, max_gen_len=40, logprobs=True)[0]
        constrained = llama.text_completion([prompt], temperature=0, max_gen_len=40, logprobs=True,
                                            response_format=response_format)[0]
        assert constrained["tokens"] == free["tokens"] and constrained["generation"] == free["generation"]


@pytest.mark.parametrize("response_format", ANY_TEXT)
@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_grammar_of_text_keeps_bytes_that_are_no_text_out(llama3, response_format):
    """Where the model's greedy choice is no UTF-8 text (a lone continuation byte: the reply's
    text gets U+FFFD), a grammar of text takes the best token that is text; before that point
    the two are identical.  llguidance matches text, not bytes, which is right for a grammar of
    text; the difference is shown here rather than hidden."""
    llama = llama3
    tokenizer = llama.tokenizer
    checked = 0
    for prompt in ["the", "Hello", "it is", "x", "An"]:
        ids = tokenizer.encode(prompt, bos=True, eos=False)
        free = llama.generate([ids], max_gen_len=40, temperature=0)[0][0]
        constrained = llama.engine.submit(ids, _settings(llama, response_format)).result().tokens
        k = first_invalid_utf8(tokenizer, [t for t in free if t not in tokenizer.special_tokens.values()])
        bad = next((j for j, t in enumerate(free) if t in tokenizer.special_tokens.values()), len(free))
        k = min(k, bad)
        assert constrained[:k] == free[:k]
        if k < len(free):
            checked += 1
            assert constrained[k] != free[k]
            assert first_invalid_utf8(tokenizer, constrained) == len(constrained)  # text throughout
    assert checked  # the random model does write no-text bytes: the case is exercised


def _settings(llama, response_format):
    from llama.engine import RequestSettings

    return RequestSettings(max_new_tokens=40, temperature=0, grammar=llama._grammar(response_format))


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_masks_are_computed_while_the_model_runs(llama3, monkeypatch):
    """The step's masks are computed on the sampler's worker thread, started before the model
    runs (Sampler.start_masks), and give the tokens that masks computed after it give; a
    request whose prompt finishes in the step gets its first mask the same way."""
    import threading

    from llama.engine import RequestSettings
    from llama.structured import GrammarMasker

    llama = llama3
    fmt = json_schema_format(SCHEMAS["enum_and_array"])
    grammar = llama._grammar(fmt)
    prompts = [llama.tokenizer.encode(p, bos=True, eos=False) for p in ("the cat", "Hello", "the")]

    def run() -> list:
        settings = [RequestSettings(max_new_tokens=ROOM, temperature=1.0, seed=s, grammar=g)
                    for s, g in ((1, grammar), (2, None), (3, grammar))]
        handles = [llama.engine.submit(p, s) for p, s in zip(prompts, settings)]
        return [h.result() for h in handles]

    threads = []
    fill = GrammarMasker.fill
    monkeypatch.setattr(GrammarMasker, "fill", lambda self, *a, **k: threads.append(threading.current_thread().name)
                        or fill(self, *a, **k))
    early = run()
    assert threads and all(name.startswith("grammar-masks") for name in threads)
    threads.clear()
    monkeypatch.setattr(llama.engine.sampler, "start_masks", lambda requests, proposals=None: None)
    late = run()
    assert threads and not any(name.startswith("grammar-masks") for name in threads)
    assert [r.tokens for r in early] == [r.tokens for r in late]
    for result in (early[0], early[2]):
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(result.text), SCHEMAS["enum_and_array"])
