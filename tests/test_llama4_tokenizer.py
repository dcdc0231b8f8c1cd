"""Llama 4's tokenizer and chat format against Meta's llama-models, with the real
``tokenizer.model`` it ships."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from llama.formats.chat import Llama3ChatFormat, Llama4ChatFormat, chat_format_for
from llama.tokenizer import Llama4Tokenizer, TiktokenTokenizer, load_tokenizer

llama_models = pytest.importorskip("llama_models")
LLAMA4_TOKENIZER = Path(llama_models.__file__).parent / "llama4" / "tokenizer.model"

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "I'm sure they'll say it's THE Best's \"quote\"",
    "Numbers 1234567 and 3.14159, dates 2025-04-05",
    "Ünïcödé: café, naïve, 東京, Москва, ελληνικά, 😀👍🏽",
    "code:\n\tdef f(x):\n\t\treturn x ** 2  # square\r\n",
    "<|eot|> <|header_start|>user<|header_end|> typed as text",
    "a/b/c\n\n\nline",
]


@pytest.fixture(scope="module")
def ours() -> Llama4Tokenizer:
    return load_tokenizer(LLAMA4_TOKENIZER)


@pytest.fixture(scope="module")
def meta():
    from llama_models.llama4.tokenizer import Tokenizer

    return Tokenizer(LLAMA4_TOKENIZER)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_llama4_file_is_detected(ours, llama3_tokenizer_path):
    assert type(ours) is Llama4Tokenizer and ours.n_words == 202048
    assert isinstance(chat_format_for(ours), Llama4ChatFormat)
    llama3 = load_tokenizer(llama3_tokenizer_path)
    assert type(llama3) is TiktokenTokenizer and isinstance(chat_format_for(llama3), Llama3ChatFormat)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_special_tokens_and_stop_tokens_match_meta(ours, meta):
    assert ours.special_tokens == meta.special_tokens  # all 2,048, names and ids
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.eot_id, ours.eom_id) == (
        meta.bos_id, meta.eos_id, meta.pad_id, meta.eot_id, meta.eom_id)
    assert ours.stop_tokens == set(meta.stop_tokens) == {200001, 200007, 200008}  # <|end_of_text|>, <|eom|>, <|eot|>
    assert ours.special_tokens["<|python_start|>"] == 200016 and ours.special_tokens["<|header_start|>"] == 200005


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_meta(ours, meta, text):
    assert ours.encode(text, bos=True, eos=True) == meta.encode(text, bos=True, eos=True)
    ids = ours.encode(text, bos=False, eos=False)
    assert ours.decode(ids) == meta.decode(ids) == text


@pytest.fixture(scope="module")
def meta_chat(meta):
    """llama-models' Llama 4 ChatFormat.  Its module imports torchvision for images;
    where torchvision is not installed, empty stand-ins let the text path import.  They are
    taken out of ``sys.modules`` again at once: left there, they made transformers (which asks
    ``importlib.util.find_spec("torchvision")``) fail in this module's later tests."""
    stand_ins: dict[str, types.ModuleType] = {}
    if "torchvision" not in sys.modules:
        try:
            import torchvision  # noqa: F401
        except ImportError:
            tv = types.ModuleType("torchvision")
            tv.transforms = types.ModuleType("torchvision.transforms")
            tv.transforms.functional = types.ModuleType("torchvision.transforms.functional")
            stand_ins = {"torchvision": tv, "torchvision.transforms": tv.transforms,
                         "torchvision.transforms.functional": tv.transforms.functional}
            sys.modules.update(stand_ins)
    try:
        from llama_models.llama4.chat_format import ChatFormat
    finally:
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
    return ChatFormat(meta)


DIALOGS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "  Why is the sky blue?\n"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about <|eot|> tokens."},
    ],
    [
        {"role": "user", "content": "Run 2+2 in Python"},
        {"role": "assistant", "content": "print(2 + 2)"},
        {"role": "tool", "content": "4"},
    ],
]


@pytest.mark.parametrize("dialog", DIALOGS, ids=range(len(DIALOGS)))
def test_chat_prompts_match_meta(ours, meta_chat, dialog):
    from llama_models.datatypes import RawMessage

    expected = meta_chat.encode_dialog_prompt([RawMessage(role=m["role"], content=m["content"]) for m in dialog]).tokens
    assert Llama4ChatFormat(ours).encode_dialog_prompt(dialog) == expected


def test_chat_prompt_golden_ids(ours):
    """The ids, labelled, for a short dialog (an independent statement of the template)."""
    tokens = Llama4ChatFormat(ours).encode_dialog_prompt([{"role": "user", "content": "Hi"}])
    enc = lambda s: ours.encode(s, bos=False, eos=False)  # noqa: E731
    assert tokens == [
        200000,  # <|begin_of_text|>
        200005, *enc("user"), 200006, *enc("\n\n"),  # <|header_start|>user<|header_end|>\n\n
        *enc("Hi"), 200008,  # <|eot|>
        200005, *enc("assistant"), 200006, *enc("\n\n"),
    ]


def test_ipython_role_is_a_tool_message(ours):
    fmt = Llama4ChatFormat(ours)
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert fmt.encode_dialog_prompt(base + [{"role": "ipython", "content": "4"}]) == fmt.encode_dialog_prompt(
        base + [{"role": "tool", "content": "4"}])


def test_bad_dialogs_are_refused(ours):
    fmt = Llama4ChatFormat(ours)
    with pytest.raises(ValueError, match="must end with"):
        fmt.encode_dialog_prompt([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(ValueError, match="unknown role"):
        fmt.encode_dialog_prompt([{"role": "robot", "content": "a"}])


@pytest.mark.slow
def test_hf_tokenizer_files_render_llama4_chats_as_the_library(tmp_path):
    """meta_to_hf's tokenizer files for the real Llama 4 tokenizer: transformers'
    AutoTokenizer renders a chat (system, multi-turn, a tool result) to the ids of
    Llama4ChatFormat."""
    import json

    import llama_models
    from transformers import AutoTokenizer

    from llama.convert.hf_tokenizer import hf_tokenizer_files
    from llama.formats.chat import chat_format_for
    from llama.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(llama_models.__file__).parent / "llama4" / "tokenizer.model")
    for name, content in hf_tokenizer_files(tok, 8192).items():
        (tmp_path / name).write_text(json.dumps(content, ensure_ascii=False))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    dialogs = [
        [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi there!"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": " What is 2+2?"}],
        [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Let me look."},
         {"role": "tool", "content": '{"sky": "clear"}'}],
    ]
    for dialog in dialogs:
        theirs = hf.apply_chat_template(dialog, tokenize=True, add_generation_prompt=True)
        theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
        assert list(theirs) == chat_format_for(tok).encode_dialog_prompt(dialog)
