"""Tokenizers: detection from the file, the real Llama 3 tokenizer, SentencePiece, long inputs."""

from __future__ import annotations

import pytest

from llama.tokenizer import SentencePieceTokenizer, TiktokenTokenizer, load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "Numbers 1234567 and symbols #@!$%^&*()",
    "Ünïcödé: café, 東京, Москва, 😀🚀",
    "line one\nline two\r\n\ttabbed",
    "It's what we've done; they'll see.",
    "",
]


@pytest.fixture(scope="module")
def llama3_tok(llama3_tokenizer_path):
    return load_tokenizer(llama3_tokenizer_path)


@pytest.fixture(scope="module")
def meta_llama3_tok():
    """Meta's own tokenizer class from the llama-models package, for comparison."""
    pytest.importorskip("llama_models")
    from llama_models.llama3.tokenizer import Tokenizer

    return Tokenizer.get_instance()


def test_detects_each_kind(llama3_tokenizer_path, sp_tokenizer_path, tmp_path):
    assert isinstance(load_tokenizer(llama3_tokenizer_path), TiktokenTokenizer)
    assert isinstance(load_tokenizer(sp_tokenizer_path), SentencePieceTokenizer)
    junk = tmp_path / "tokenizer.model"
    junk.write_bytes(b"\x00\x01garbage" * 100)
    with pytest.raises(ValueError, match="neither a SentencePiece model"):
        load_tokenizer(junk)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing.model")


def test_llama3_vocabulary_and_control_ids(llama3_tok):
    assert llama3_tok.n_words == 128256
    s = llama3_tok.special_tokens
    assert (s["<|begin_of_text|>"], s["<|end_of_text|>"]) == (128000, 128001)
    assert (s["<|start_header_id|>"], s["<|end_header_id|>"]) == (128006, 128007)
    assert (s["<|eom_id|>"], s["<|eot_id|>"], s["<|python_tag|>"]) == (128008, 128009, 128010)
    assert s["<|reserved_special_token_0|>"] == 128002
    # llama-models' names (issue 10): <|step_id|> and <|image|> are named, the rest shift.
    assert (s["<|step_id|>"], s["<|image|>"]) == (128005, 128011)
    assert s["<|reserved_special_token_2|>"] == 128012 and s["<|reserved_special_token_245|>"] == 128255
    assert llama3_tok.stop_tokens == {128001, 128008, 128009}


@pytest.mark.parametrize("text", TEXTS)
def test_llama3_matches_meta_tokenizer(llama3_tok, meta_llama3_tok, text):
    ours = llama3_tok.encode(text, bos=True, eos=True)
    assert ours == meta_llama3_tok.encode(text, bos=True, eos=True)
    assert llama3_tok.decode(ours[1:-1]) == text


def test_llama3_known_ids(llama3_tok):
    assert llama3_tok.encode("Hello world", bos=True, eos=False) == [
        128000,  # <|begin_of_text|>
        9906,  # Hello
        1917,  # " world"
    ]


def test_llama3_control_strings_in_text_stay_text(llama3_tok):
    ids = llama3_tok.encode("<|eot_id|><|begin_of_text|>", bos=False, eos=False)
    assert not set(ids) & set(llama3_tok.special_tokens.values())
    assert llama3_tok.decode(ids) == "<|eot_id|><|begin_of_text|>"


@pytest.mark.parametrize("text", ["a" * 1_000_000, " " * 600_000, ("x" * 30_000 + " " * 30_000) * 10])
def test_llama3_very_long_runs_do_not_panic(llama3_tok, text):
    ids = llama3_tok.encode(text, bos=False, eos=False)
    assert llama3_tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_matches_raw_model(sp_tokenizer_path, text):
    import sentencepiece

    raw = sentencepiece.SentencePieceProcessor(model_file=str(sp_tokenizer_path))
    tok = load_tokenizer(sp_tokenizer_path)
    assert (tok.bos_id, tok.eos_id, tok.n_words) == (raw.bos_id(), raw.eos_id(), raw.vocab_size())
    assert tok.stop_tokens == {raw.eos_id()}
    ids = tok.encode(text, bos=True, eos=True)
    assert ids == [raw.bos_id()] + raw.encode(text) + [raw.eos_id()]
    assert tok.decode(ids) == raw.decode(raw.encode(text))


def test_sentencepiece_control_strings_stay_text(sp_tokenizer_path):
    tok = load_tokenizer(sp_tokenizer_path)
    ids = tok.encode("<s></s>", bos=False, eos=False)
    assert tok.bos_id not in ids and tok.eos_id not in ids


def test_decode_rejects_ids_outside_vocab(llama3_tok):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llama3_tok.decode([128256])
    with pytest.raises(TypeError):
        llama3_tok.encode(b"bytes", bos=False, eos=False)


def test_decode_takes_only_integer_ids(llama3_tok):
    with pytest.raises(TypeError, match="must be ints"):
        llama3_tok.decode([1.9])
    with pytest.raises(TypeError, match="not a string"):
        llama3_tok.decode("123")


def test_llama3_control_token_names_match_meta(llama3_tok, meta_llama3_tok):
    """Every one of the 256 control tokens has llama-models' name and id."""
    assert llama3_tok.special_tokens == meta_llama3_tok.special_tokens
