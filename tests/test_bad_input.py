"""Bad input gets a clear exception, and the same instance keeps serving.

Each case names the call, the exception type and a fragment of the message that
tells the user what was wrong.  After every rejected request the instance must still
answer a valid one, with the same result as before (nothing half-done left behind).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import helpers
from llama import Llama

GOOD_DIALOG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def llama(llama3_checkpoint):
    ckpt, tok = llama3_checkpoint.ckpt_dir, llama3_checkpoint.tokenizer_path
    return Llama.build(ckpt, tok, max_seq_len=32, max_batch_size=2, device="cpu")


@pytest.fixture(scope="module")
def baseline(llama):
    return llama.text_completion(["the cat"], temperature=0, max_gen_len=6)


# (name, call, exception, message fragment)
GENERATION_CASES = [
    ("prompt longer than max_seq_len", lambda lm: lm.text_completion(["the cat " * 40]), ValueError,
     "more than max_seq_len=32"),
    ("token prompt longer than max_seq_len", lambda lm: lm.generate([[1] * 33], 4), ValueError,
     "more than max_seq_len"),
    ("batch larger than max_batch_size", lambda lm: lm.text_completion(["a", "b", "c"]), ValueError,
     "exceed max_batch_size=2"),
    ("negative temperature", lambda lm: lm.text_completion(["a"], temperature=-0.1), ValueError, "temperature must be"),
    ("NaN temperature", lambda lm: lm.text_completion(["a"], temperature=float("nan")), ValueError,
     "temperature must be"),
    ("infinite temperature", lambda lm: lm.text_completion(["a"], temperature=float("inf")), ValueError,
     "temperature must be"),
    ("temperature of the wrong type", lambda lm: lm.text_completion(["a"], temperature="hot"), TypeError,
     "temperature must be a number"),
    ("top_p of 0", lambda lm: lm.text_completion(["a"], top_p=0), ValueError, "top_p must be in (0, 1]"),
    ("top_p above 1", lambda lm: lm.text_completion(["a"], top_p=1.5), ValueError, "top_p must be in (0, 1]"),
    ("top_p of None", lambda lm: lm.text_completion(["a"], top_p=None), TypeError, "top_p must be a number"),
    ("top_k of 0", lambda lm: lm.text_completion(["a"], top_k=0), ValueError, "top_k must be >= 1"),
    ("top_k float", lambda lm: lm.text_completion(["a"], top_k=2.5), TypeError, "top_k must be an int"),
    ("negative max_gen_len", lambda lm: lm.text_completion(["a"], max_gen_len=-1), ValueError,
     "max_gen_len must be in [0, 31]"),
    ("absurd max_gen_len", lambda lm: lm.text_completion(["a"], max_gen_len=10**9), ValueError,
     "max_gen_len must be in [0, 31]"),
    ("max_gen_len as a string", lambda lm: lm.text_completion(["a"], max_gen_len="10"), TypeError,
     "max_gen_len must be an int"),
    ("generate without max_gen_len", lambda lm: lm.generate([[1]], None), TypeError, "max_gen_len must be an int"),
    ("prompts as one string", lambda lm: lm.text_completion("the cat"), TypeError, "prompts must be a list of str"),
    ("a prompt that is not a string", lambda lm: lm.text_completion(["a", 3]), TypeError,
     "prompts must be a list of str"),
    ("token prompts with a string", lambda lm: lm.generate([["a"]], 4), TypeError, "list of int token ids"),
    ("token id outside the vocabulary", lambda lm: lm.generate([[1, 10**6]], 4), ValueError, "outside [0, 556)"),
    ("negative token id", lambda lm: lm.generate([[-1]], 4), ValueError, "outside [0, 556)"),
    ("empty token prompt", lambda lm: lm.generate([[]], 4), ValueError, "is empty"),
    ("empty stop string", lambda lm: lm.text_completion(["a"], stop=[""]), ValueError, "must not be empty"),
    ("stop that is not strings", lambda lm: lm.text_completion(["a"], stop=[3]), TypeError, "list of strings"),
    ("seed of the wrong type", lambda lm: lm.text_completion(["a"], seed="x"), TypeError, "seed must be an int"),
    ("stream of a list", lambda lm: lm.text_completion_stream(["a"]), TypeError, "prompt must be a str"),
    ("chat: dialogs not a list", lambda lm: lm.chat_completion("hi"), TypeError, "dialogs must be a list"),
    ("chat: unknown role", lambda lm: lm.chat_completion([[{"role": "bot", "content": "x"}]]), ValueError,
     "dialog 0: message 0 has unknown role 'bot'"),
    # (two user messages in a row are a valid Llama 3 dialog, as in llama-models: issue 10)
    ("chat: wrong order",
     lambda lm: lm.chat_completion([GOOD_DIALOG,
                                    [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]]),
     ValueError, "dialog 1: message 1 has role 'system', but after a 'user' message"),
    ("chat: system not first",
     lambda lm: lm.chat_completion([[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]]),
     ValueError, "after a 'user' message the dialog needs assistant"),
    ("chat: content not a string", lambda lm: lm.chat_completion([[{"role": "user", "content": ["x"]}]]), TypeError,
     "content must be a str"),
    ("chat: message not a dict", lambda lm: lm.chat_completion([["hello"]]), TypeError,
     "must be a dict with 'role' and 'content'"),
    ("chat: ends with the assistant",
     lambda lm: lm.chat_completion([[*GOOD_DIALOG, {"role": "assistant", "content": "x"}]]),
     ValueError, "must end with 'ipython' or 'user'"),
    ("chat: empty dialog", lambda lm: lm.chat_completion([[]]), ValueError, "at least one message"),
    ("chat: dialog too long", lambda lm: lm.chat_completion([[{"role": "user", "content": "word " * 60}]]), ValueError,
     "more than max_seq_len"),
    ("chat stream: bad dialog", lambda lm: lm.chat_completion_stream([{"role": "assistant", "content": "x"}]),
     ValueError,
     "first the dialog needs"),
    ("text with surrogates", lambda lm: lm.text_completion(["bad \ud800 text"]), ValueError, "surrogate"),
]


@pytest.mark.parametrize("name, call, error, message", GENERATION_CASES, ids=[c[0] for c in GENERATION_CASES])
def test_bad_request_is_refused_and_the_instance_keeps_serving(llama, baseline, name, call, error, message):
    with pytest.raises(error) as info:
        call(llama)
    assert message in str(info.value)
    assert not isinstance(info.value, AssertionError)
    assert llama.text_completion(["the cat"], temperature=0, max_gen_len=6) == baseline


def test_empty_lists_return_empty_lists(llama):
    assert llama.text_completion([]) == []
    assert llama.chat_completion([]) == []
    assert llama.generate([], max_gen_len=4) == ([], None)
    assert llama.generate([], max_gen_len=4, logprobs=True) == ([], [])


# -- build: files and settings ---------------------------------------------------------------

@pytest.fixture
def files(tmp_path, llama3_checkpoint):
    """A writable copy of a good checkpoint."""
    _, tok, params, weights = llama3_checkpoint
    return helpers.Checkpoint(helpers.write_checkpoint(tmp_path / "ckpt", params, weights), tok, params, weights)


def build(ckpt, tok, **kw):
    return helpers.build((ckpt, tok), **{"max_seq_len": 32, "max_batch_size": 1, **kw})


def test_missing_paths(files, tmp_path):
    ckpt, tok, _, _ = files
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        build(tmp_path / "nope", tok)
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        build(ckpt, tmp_path / "nope.model")
    (ckpt / "params.json").unlink()
    with pytest.raises(FileNotFoundError, match="params.json not found"):
        build(ckpt, tok)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint shards \(\*\.pth\)"):
        build(empty, tok)


def test_options_after_the_two_paths_are_keyword_only(files):
    """Llama.build(ckpt_dir, tokenizer_path, *, ...): a slip of position (max_batch_size where
    max_seq_len belongs) is a TypeError before anything is read; Meta's calls, by keyword, work."""
    from llama.checkpoint.loader import LoadOptions

    ckpt, tok, _, _ = files
    with pytest.raises(TypeError, match="positional argument"):
        Llama.build(ckpt, tok, 32, 1)
    with pytest.raises(TypeError, match="positional argument"):
        LoadOptions(32, 1)
    llama = Llama.build(ckpt_dir=str(ckpt), tokenizer_path=str(tok), max_seq_len=32, max_batch_size=1, device="cpu")
    assert llama.max_seq_len == 32 and llama.max_batch_size == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root, who may read any file: "
                                               "run as another user to test the unreadable-file error")
def test_unreadable_tokenizer(files, tmp_path):
    ckpt, tok, _, _ = files
    copy = tmp_path / "tokenizer.model"
    copy.write_bytes(tok.read_bytes())
    copy.chmod(0)
    with pytest.raises(PermissionError, match="not readable"):
        build(ckpt, copy)


@pytest.mark.parametrize(
    "params_text, message",
    [
        ("{not json", "is not valid JSON"),
        ("[]", "must hold a JSON object"),
        (json.dumps({"dim": 64, "n_layers": 2, "n_heads": 5, "vocab_size": 556}), "not divisible by n_heads"),
        (json.dumps({"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 3, "vocab_size": 556}),
         "multiple of n_kv_heads"),
        (json.dumps({"dim": 64, "n_layers": -2, "n_heads": 4, "vocab_size": 556}),
         "n_layers must be a positive integer"),
        (json.dumps({"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 556, "norm_eps": "tiny"}),
         "norm_eps must be a positive number"),
        # deeper than json's parser recurses (was a raw RecursionError), and deep enough to
        # parse but not to be a params.json
        pytest.param("[" * 100_000 + "]" * 100_000, "nests lists or objects more than", id="nested-100000"),
        pytest.param('{"dim": ' + "[" * 500 + "]" * 500 + "}", "nests lists or objects more than", id="nested-500"),
    ],
)
def test_bad_params_json(files, params_text, message):
    ckpt, tok, _, _ = files
    (ckpt / "params.json").write_text(params_text)
    with pytest.raises(ValueError, match=message):
        build(ckpt, tok)


def _special_file(path, kind):
    """A FIFO (reading blocks until a writer comes) or a link to /dev/zero (reading never ends) at ``path``."""
    if kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("no FIFOs here")
        os.mkfifo(path)
    else:
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero here")
        path.symlink_to("/dev/zero")
    return path


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_params_and_tokenizer_that_are_not_regular_files(files, tmp_path, kind):
    """Used to be reported as 'not found' (and a reader that opened them would hang or fill memory)."""
    ckpt, tok, _, _ = files
    bad_tok = _special_file(tmp_path / "tokenizer.model", kind)
    with pytest.raises(ValueError, match=rf"tokenizer file {bad_tok} is not a regular file"):
        build(ckpt, bad_tok)
    (ckpt / "params.json").unlink()
    _special_file(ckpt / "params.json", kind)
    with pytest.raises(ValueError, match=rf"{ckpt / 'params.json'} is not a regular file"):
        build(ckpt, tok)


def test_oversized_params_and_tokenizer_are_refused_unread(files, tmp_path, llama3_tokenizer_path):
    """A params.json of megabytes, a tokenizer.model ten times Meta's largest (Llama 4's,
    shipped in llama_models): refused by size, not parsed into memory."""
    ckpt, tok, params, _ = files
    llama4_tok = llama3_tokenizer_path.parent.parent / "llama4" / "tokenizer.model"
    huge = tmp_path / "tokenizer.model"
    with open(huge, "wb") as f:  # sparse: takes no disk space
        f.truncate(10 * llama4_tok.stat().st_size + 1)
    with pytest.raises(ValueError, match=r"tokenizer file .* is \d+ bytes, over"):
        build(ckpt, huge)
    (ckpt / "params.json").write_text(" " * 10 * 2**20 + json.dumps(params))
    with pytest.raises(ValueError, match=r"params\.json is larger than"):
        build(ckpt, tok)


def test_tokenizer_that_does_not_fit_the_checkpoint(files, llama3_tokenizer_path):
    ckpt, _, _, _ = files
    with pytest.raises(ValueError, match="has 128256 tokens but the model's vocabulary has 556"):
        build(ckpt, llama3_tokenizer_path)


def test_truncated_and_corrupted_shards(files):
    ckpt, tok, _, _ = files
    shard = ckpt / "consolidated.00.pth"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="consolidated.00.pth: the file is truncated, corrupted"):
        build(ckpt, tok)
    shard.write_bytes(os.urandom(len(data)))
    with pytest.raises(ValueError, match="consolidated.00.pth"):
        build(ckpt, tok)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"max_seq_len": 0}, ValueError, "max_seq_len must be positive"),
        ({"max_batch_size": "4"}, TypeError, "max_batch_size must be an int"),
        ({"model_parallel_size": 2}, ValueError, "model_parallel_size=2 but 1 process(es) were started"),
        ({"device": "tpu"}, ValueError, "device must be 'cpu', 'cuda'"),
        ({"device": 3}, TypeError, "device must be a str or torch.device"),
        ({"dtype": "float8"}, ValueError, "unknown dtype 'float8'"),
        ({"dtype": torch.int8}, ValueError, "not supported"),
        ({"quantize": "int3"}, ValueError, "quantize must be None or one of"),
    ],
)
def test_bad_build_settings(files, kwargs, error, message):
    ckpt, tok, _, _ = files
    with pytest.raises(error) as info:
        build(ckpt, tok, **kwargs)
    assert message in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a GPU is available here: this test checks the message given where there is none")
def test_cuda_asked_for_without_a_gpu(files):
    ckpt, tok, _, _ = files
    with pytest.raises(RuntimeError, match="CUDA is not available here; use device='cpu'"):
        build(ckpt, tok, device="cuda")


def test_memory_is_checked_before_allocating(files):
    """A KV cache far beyond this machine's RAM is refused up front, with the numbers
    and the knobs; nothing is allocated (the call returns at once)."""
    ckpt, tok, _, _ = files
    with pytest.raises(RuntimeError) as info:
        build(ckpt, tok, max_seq_len=10**8, max_batch_size=64)
    text = str(info.value)
    for fragment in ("not enough memory on cpu", "KV cache", "max_batch_size=64", "max_seq_len=100000000",
                     "Lower max_batch_size or max_seq_len"):
        assert fragment in text
    # Halving the cache (bfloat16) or splitting it over every process this model allows would
    # still need thousands of GiB: the advice names neither, as each would be refused in turn.
    assert "bfloat16" not in text and "more processes" not in text, text
