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


@pytest.fixture(params=["llama3", "llama2"])
def llama(request):
    return build(request.getfixturevalue(f"{request.param}_checkpoint"), max_seq_len=512, max_batch_size=4)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_replies_validate_against_their_schema(llama, name):
    schema = SCHEMAS[name]
    for seed in SEEDS:
        (out,) = llama.text_completion(["the"], temperature=1.0, top_p=1.0, max_gen_len=ROOM, seed=seed,
                                       response_format=json_schema_format(schema))
        jsonschema.validate(json.loads(out["generation"]), schema)


@pytest.mark.parametrize("regex", REGEXES)
def test_sampled_replies_match_their_regex(llama, regex):
    for seed in SEEDS:
        (out,) = llama.text_completion(["the"], temperature=1.0, top_p=1.0, max_gen_len=ROOM, seed=seed,
                                       response_format={"type": "regex", "regex": regex})
        assert re.fullmatch(regex, out["generation"]), out


def test_a_chat_reply_is_the_constrained_text_as_content(llama3_checkpoint):
    llama = build(llama3_checkpoint, max_seq_len=512)
    dialog = [{"role": "user", "content": "a color please"}]
    schema = SCHEMAS["enum_and_array"]
    (reply,) = llama.chat_completion([dialog], temperature=1.0, max_gen_len=ROOM, seed=3,
                                     response_format=json_schema_format(schema))
    message = reply["generation"]
    jsonschema.validate(json.loads(message["content"]), schema)
    assert message["stop_reason"] == "end_of_turn" and not message.get("tool_calls")


def test_constrained_and_free_requests_share_a_batch(llama3_checkpoint):
    """In one batch, each request gets what it gets alone: greedy tokens identical."""
    llama = build(llama3_checkpoint, max_seq_len=512, max_batch_size=4)
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


def test_a_stream_gives_the_text_of_the_call(llama3_checkpoint):
    llama = build(llama3_checkpoint, max_seq_len=512)
    fmt = json_schema_format(SCHEMAS["integers"])
    (whole,) = llama.text_completion(["the"], temperature=1.0, max_gen_len=ROOM, seed=7, response_format=fmt)
    pieces = "".join(llama.text_completion_stream("the", temperature=1.0, max_gen_len=ROOM, seed=7,
                                                  response_format=fmt))
    assert pieces == whole["generation"]
    jsonschema.validate(json.loads(pieces), SCHEMAS["integers"])


def test_a_reply_cut_by_max_gen_len_ends_for_length(llama3_checkpoint):
    llama = build(llama3_checkpoint, max_seq_len=512)
    from llama.engine import RequestSettings

    grammar = llama._grammar(json_schema_format(SCHEMAS["nested"]))
    result = llama.engine.submit(llama.tokenizer.encode("the", bos=True, eos=False),
                                 RequestSettings(max_new_tokens=3, temperature=1.0, seed=1, grammar=grammar)).result()
    assert result.finish_reason == "length" and len(result.tokens) == 3 and result.text.startswith("{")


def test_log_probabilities_are_those_of_the_masked_distribution(llama3_checkpoint):
    """A constrained token's log-probability is the model's, renormalised over the tokens the
    grammar allows at that step: log p(t) - logsumexp(log p(allowed))."""
    import torch

    llama = build(llama3_checkpoint, max_seq_len=512)
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


@pytest.mark.parametrize("bad, field", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}, "response_format.json_schema"),
    ({"type": "regex", "regex": "(unclosed"}, "response_format.regex"),
    ({"type": "xml"}, "response_format.type"),
])
def test_a_format_that_cannot_be_compiled_is_refused_before_generating(llama3_checkpoint, bad, field):
    llama = build(llama3_checkpoint, max_seq_len=512)
    with pytest.raises(ValueError, match=re.escape(field)):
        llama.text_completion(["the"], max_gen_len=5, response_format=bad)
    assert llama.engine.stats()["requests_total"] == 0
