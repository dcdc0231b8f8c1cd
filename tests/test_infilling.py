"""Code Llama infilling: prompt ids as Meta's codellama reference builds them, written out
here with SentencePiece calls (its ``infilling_prompt_tokens`` and ``encode_infilling``),
for a model trained in the test with the infilling pieces."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama.formats.infilling import check_infilling, decode_infilling, infilling_prompt_tokens, infilling_stop_tokens
from llama.tokenizer import load_tokenizer

PREFIX = 'def remove_non_ascii(s: str) -> str:\n    """ '
SUFFIX = "\n    return result\n"


@pytest.fixture(scope="module")
def tok(codellama_tokenizer_path):
    return load_tokenizer(codellama_tokenizer_path)


class Reference:
    """Meta's codellama construction, step by step with SentencePiece itself."""

    def __init__(self, model_path):
        from sentencepiece import SentencePieceProcessor

        self.sp = sp = SentencePieceProcessor(model_file=str(model_path))
        self.bos = sp.bos_id()
        self.pre, self.suf, self.mid, self.eot = (sp.piece_to_id(f"\u2581<{p}>") for p in ("PRE", "SUF", "MID", "EOT"))

    def encode_infilling(self, s):
        return self.sp.encode("\u263a" + s)[2:]  # no leading space: drop "▁", "☺"

    def decode_infilling(self, t):
        return self.sp.decode([self.sp.piece_to_id("\u263a")] + t)[1:]

    def prompt(self, pre, suf, suffix_first=False):
        if suffix_first:  # "<PRE> <SUF>{suf} <MID> {pre}"
            return [self.bos, self.pre, self.suf] + self.encode_infilling(suf) + [self.mid] + self.sp.encode(pre)
        # "<PRE> {pre} <SUF>{suf} <MID>"
        return [self.bos, self.pre] + self.sp.encode(pre) + [self.suf] + self.encode_infilling(suf) + [self.mid]


@pytest.fixture(scope="module")
def ref(codellama_tokenizer_path):
    return Reference(codellama_tokenizer_path)


def test_infilling_ids(tok, ref):
    assert (tok.prefix_id, tok.suffix_id, tok.middle_id, tok.eot_id, tok.step_id) == (3, 4, 5, 6, 7)
    assert (ref.pre, ref.suf, ref.mid, ref.eot) == (3, 4, 5, 6)
    assert infilling_stop_tokens(tok) == {tok.eot_id, tok.eos_id}


@pytest.mark.parametrize("suffix_first", [False, True])
@pytest.mark.parametrize(
    "prefix, suffix",
    [(PREFIX, SUFFIX), ("", ""), ("x = ", " + 1"), ("  indented", "  two spaces\n"), ("caf\u00e9 = '", "' # \u6771\n")],
)
def test_prompt_matches_reference(tok, ref, prefix, suffix, suffix_first):
    ids = infilling_prompt_tokens(tok, prefix, suffix, suffix_first=suffix_first)
    assert ids == ref.prompt(prefix, suffix, suffix_first)
    assert ids[:2] == [1, 3]  # <s> <PRE>


def test_prompt_layout_written_out(tok):
    """The default layout, piece by piece: the prefix keeps SentencePiece's leading space,
    the suffix does not."""
    ids = infilling_prompt_tokens(tok, "a", "b")
    sp = tok.sp_model
    assert [sp.id_to_piece(i) for i in ids] == ["<s>", "\u2581<PRE>", "\u2581a", "\u2581<SUF>", "b", "\u2581<MID>"]


CODE = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\u2581<>"), max_size=40)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(prefix=CODE, suffix=CODE, suffix_first=st.booleans())
def test_prompt_matches_reference_on_any_code(tok, ref, prefix, suffix, suffix_first):
    assert (infilling_prompt_tokens(tok, prefix, suffix, suffix_first=suffix_first)
            == ref.prompt(prefix, suffix, suffix_first))


@pytest.mark.parametrize("middle", [" x = 1\n", "x", "", "  \n\t"])
def test_decode_stops_at_eot_and_keeps_the_leading_space(tok, ref, middle):
    generated = ref.encode_infilling(middle)
    assert decode_infilling(tok, generated + [ref.eot, 9, 10]) == ref.decode_infilling(generated) == middle
    assert decode_infilling(tok, generated + [tok.eos_id, 9]) == middle
    assert decode_infilling(tok, generated) == middle  # out of tokens


def test_models_without_infilling_are_refused(sp_tokenizer_path, llama3_tokenizer_path):
    for path in (sp_tokenizer_path, llama3_tokenizer_path):
        t = load_tokenizer(path)
        with pytest.raises(ValueError, match="needs a Code Llama tokenizer"):
            infilling_prompt_tokens(t, "a", "b")
        with pytest.raises(ValueError, match="needs a Code Llama tokenizer"):
            check_infilling(t)
    assert load_tokenizer(sp_tokenizer_path).prefix_id is None


def test_bad_arguments(tok):
    with pytest.raises(TypeError, match="prefix must be a str"):
        infilling_prompt_tokens(tok, 3, "b")


@pytest.mark.parametrize("text", ["a <PRE> b", "<EOT>", "x <SUF>", "do <step> it"])
def test_control_pieces_in_text_are_refused(tok, text):
    """SentencePiece would read these user-defined pieces out of plain text; the tokenizer
    refuses rather than let text pose as a control token."""
    with pytest.raises(ValueError, match="reads as its control token"):
        infilling_prompt_tokens(tok, text, "")
    with pytest.raises(ValueError, match="reads as its control token"):
        tok.encode(text, bos=False, eos=False)
    tok.encode(text.replace("<", "< "), bos=False, eos=False)  # near misses are text
