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


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
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


# -- files that load but would break later -----------------------------------------------------

def _rank_file(path, tokens):
    import base64

    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return path


@pytest.mark.parametrize("dropped", [[0x41], [0x00], list(range(0x80, 0x100))])
def test_rank_file_without_every_single_byte_is_refused_at_load(tmp_path, dropped):
    """Such a file used to load, and the first encode of a text holding the byte ended
    in a Rust panic that is not even an Exception."""
    tokens = [bytes([b]) for b in range(256) if b not in dropped] + [b"th", b"he"]
    path = _rank_file(tmp_path / "tokenizer.model", tokens)
    with pytest.raises(ValueError, match=rf"lacks {len(dropped)} of the 256 single-byte tokens \(0x{dropped[0]:02x}"):
        load_tokenizer(path)


def test_every_single_byte_present_loads(tmp_path):
    tokens = [bytes([b]) for b in reversed(range(256))] + [b"th"]  # any order of ranks
    tok = load_tokenizer(_rank_file(tmp_path / "tokenizer.model", tokens))
    assert tok.decode(tok.encode("A\x00\xff é", bos=False, eos=False)) == "A\x00\xff é"


def test_decodable_vocab_size(sp_tokenizer_path, caplog):
    from llama.tokenizer import MAX_VOCAB_PADDING, decodable_vocab_size

    tok = load_tokenizer(sp_tokenizer_path)
    n = tok.n_words
    assert decodable_vocab_size(tok, n) == n
    with caplog.at_level("WARNING", logger="llama.tokenizer"):
        assert decodable_vocab_size(tok, n + 64) == n  # padded to a multiple of 64: the tokenizer's ids
    assert f"ids {n}..{n + 63} are taken as padding" in caplog.text
    assert decodable_vocab_size(tok, n + MAX_VOCAB_PADDING) == n
    with pytest.raises(ValueError, match=f"has {n} tokens but the model's vocabulary has {n - 1}"):
        decodable_vocab_size(tok, n - 1)
    with pytest.raises(ValueError, match="more than a padded vocabulary has"):
        decodable_vocab_size(tok, n + MAX_VOCAB_PADDING + 1)


def test_meta_checkpoints_need_no_padding(llama3_tok):
    """Meta's own Llama 3.x checkpoints (vocab_size in Meta's llama-models registry)
    match the real tokenizer exactly; the Llama 2 tokenizer with a Llama 3 vocabulary
    (another model's tokenizer) is refused."""
    from llama_models.sku_list import all_registered_models

    from llama.tokenizer import decodable_vocab_size

    sizes = {m.arch_args["vocab_size"] for m in all_registered_models()
             if m.arch_args and "dim" in m.arch_args and m.arch_args.get("vocab_size", 0) > 100_000
             and "moe_args" not in m.arch_args}
    assert sizes == {128256}
    assert decodable_vocab_size(llama3_tok, 128256) == 128256
    with pytest.raises(ValueError):
        decodable_vocab_size(type("Llama2Tokenizer", (), {"n_words": 32000})(), 128256)
