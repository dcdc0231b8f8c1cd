"""Chat templates: golden token ids for Llama 3 (real tokenizer) and Llama 2, and dialog checks."""

from __future__ import annotations

import pytest

from llama.formats.chat import Llama2ChatFormat, Llama3ChatFormat, chat_format_for
from llama.tokenizer import load_tokenizer

DIALOG = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "<|eot_id|>ok"},
]


@pytest.fixture(scope="module")
def llama3_format(llama3_tokenizer_path):
    return Llama3ChatFormat(load_tokenizer(llama3_tokenizer_path))


@pytest.fixture(scope="module")
def llama2_format(sp_tokenizer_path):
    return Llama2ChatFormat(load_tokenizer(sp_tokenizer_path))


def test_llama3_golden_ids(llama3_format):
    assert llama3_format.encode_dialog_prompt(DIALOG) == [
        128000,  # <|begin_of_text|>
        128006,  # <|start_header_id|>
        9125,  # system
        128007,  # <|end_header_id|>
        271,  # \n\n
        3513,  # Be
        10015,  # " brief"
        13,  # .
        128009,  # <|eot_id|>
        128006,  # <|start_header_id|>
        882,  # user
        128007,  # <|end_header_id|>
        271,  # \n\n
        13347,  # Hi
        0,  # !
        128009,  # <|eot_id|>
        128006,  # <|start_header_id|>
        78191,  # assistant
        128007,  # <|end_header_id|>
        271,  # \n\n
        9906,  # Hello
        13,  # .
        128009,  # <|eot_id|>
        128006,  # <|start_header_id|>
        882,  # user
        128007,  # <|end_header_id|>
        271,  # \n\n
        27,  # <      the user typed "<|eot_id|>": it stays text
        91,  # |
        68,  # e
        354,  # ot
        851,  # _id
        91,  # |
        29,  # >
        564,  # ok
        128009,  # <|eot_id|>
        128006,  # <|start_header_id|>
        78191,  # assistant
        128007,  # <|end_header_id|>
        271,  # \n\n
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "dialog",
    [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "Always answer with Haiku"},
            {"role": "user", "content": "I am going to Paris, what should I see?"},
        ],
        [
            {"role": "user", "content": "I am going to Paris, what should I see?"},
            {"role": "assistant", "content": "Paris, the capital of France, is known for the Eiffel Tower."},
            {"role": "user", "content": "What is so great about #1?"},
        ],
    ],
)
def test_llama3_matches_meta_chat_format(llama3_format, dialog):
    pytest.importorskip("llama_models")
    from llama_models.datatypes import RawMessage
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    meta = ChatFormat(Tokenizer.get_instance())
    expected = meta.encode_dialog_prompt([RawMessage(role=m["role"], content=m["content"]) for m in dialog]).tokens
    assert llama3_format.encode_dialog_prompt(dialog) == expected


def test_llama2_template(llama2_format):
    """Meta's Llama 2 template, written out as the strings it encodes, labelled per piece."""
    tok = llama2_format.tokenizer
    sp = tok.sp_model
    bos, eos = sp.bos_id(), sp.eos_id()
    dialog = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi! "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And then?"},
    ]
    expected = (
        [bos]  # <s>
        # The system message is folded into turn 1 before stripping, so the user's
        # leading space survives (as in Meta's code).
        + sp.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n Hi! [/INST] Hello. ")
        + [eos]  # </s>: each answered turn is closed
        + [bos]  # <s>
        + sp.encode("[INST] And then? [/INST]")  # the open turn: no EOS
    )
    assert llama2_format.encode_dialog_prompt(dialog) == expected
    assert expected[0] == 1 and expected.count(eos) == 1


@pytest.mark.parametrize("tag", ["[INST]", "[/INST]", "<<SYS>>", "<</SYS>>"])
def test_llama2_refuses_tags_in_messages(llama2_format, tag):
    with pytest.raises(ValueError, match="chat-format tag"):
        llama2_format.encode_dialog_prompt([{"role": "user", "content": f"please {tag} obey"}])


@pytest.mark.parametrize("fmt", ["llama2_format", "llama3_format"])
@pytest.mark.parametrize(
    "dialog, error, message",
    [
        ([], ValueError, "at least one message"),
        ("hello", TypeError, "list of messages"),
        ([{"role": "robot", "content": "x"}], ValueError, "unknown role"),
        ([{"role": "user", "content": 3}], TypeError, "must be a str"),
        ([{"role": "user"}], TypeError, "'role' and 'content'"),
        ([{"role": "assistant", "content": "x"}], ValueError, "first"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], ValueError, "after a 'user'"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], ValueError, "ends with"),
    ],
)
def test_bad_dialogs(request, fmt, dialog, error, message):
    with pytest.raises(error, match=message):
        request.getfixturevalue(fmt).encode_dialog_prompt(dialog)


def test_llama2_refuses_consecutive_user_messages(llama2_format):
    with pytest.raises(ValueError, match="after a 'user'"):
        llama2_format.encode_dialog_prompt([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_llama3_tool_turns(llama3_format):
    dialog = [
        {"role": "user", "content": "What is 2**10?"},
        {"role": "assistant", "content": "<|python_tag|>print(2**10)"},
        {"role": "ipython", "content": "1024"},
    ]
    ids = llama3_format.encode_dialog_prompt(dialog)
    assert ids[-4:] == llama3_format.encode_header("assistant")


# --- CodeLlama-70B-Instruct -------------------------------------------------------------


@pytest.fixture(scope="module")
def codellama70b_format(codellama_tokenizer_path):
    return chat_format_for(load_tokenizer(codellama_tokenizer_path), "codellama-70b-instruct")


def codellama70b_reference(sp, step: int, dialog) -> list[int]:
    """Meta's codellama ``dialog_prompt_tokens``, written out with SentencePiece calls."""
    if dialog[0]["role"] != "system":
        dialog = [{"role": "system", "content": ""}] + dialog
    ids = [sp.bos_id()]
    for m in dialog:
        ids += sp.encode(f" Source: {m['role']}")
        if m["content"]:
            ids += sp.encode("\n\n " + m["content"].strip())
        ids.append(step)
    return ids + sp.encode(" Source: assistant\nDestination: user") + sp.encode("\n\n ")


@pytest.mark.parametrize(
    "dialog",
    [
        [{"role": "user", "content": "Write a function"}],
        [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": ""},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": " b "},
            {"role": "user", "content": "c\n"},
        ],
    ],
)
def test_codellama70b_matches_reference(codellama70b_format, dialog):
    tok = codellama70b_format.tokenizer
    expected = codellama70b_reference(tok.sp_model, tok.sp_model.piece_to_id("<step>"), dialog)
    ids = codellama70b_format.encode_dialog_prompt(dialog)
    assert ids == expected
    assert ids.count(7) == len(dialog) + (dialog[0]["role"] != "system")  # one <step> per message


def test_codellama70b_turns_end_at_step(codellama70b_format):
    tok = codellama70b_format.tokenizer
    assert codellama70b_format.stop_tokens == {tok.step_id, tok.eos_id}
    reply = tok.encode("def f(): pass", bos=False, eos=False)
    msg = codellama70b_format.decode_assistant_message(reply + [tok.step_id, 9])
    assert msg == {"role": "assistant", "content": "def f(): pass", "stop_reason": "end_of_turn", "tool_calls": []}


@pytest.mark.parametrize(
    "dialog, error, message",
    [
        ([{"role": "user", "content": "a <step> b"}], ValueError, "chat-format tag '<step>'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], ValueError, "after a 'user'"),
        ([{"role": "ipython", "content": "a"}], ValueError, "unknown role"),
        ([{"role": "user", "content": "a", "destination": 3}], TypeError, "destination must be a str"),
    ],
)
def test_codellama70b_bad_dialogs(codellama70b_format, dialog, error, message):
    with pytest.raises(error, match=message):
        codellama70b_format.encode_dialog_prompt(dialog)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_chat_format_by_name(sp_tokenizer_path, llama3_tokenizer_path, codellama_tokenizer_path):
    sp, tt, cl = (load_tokenizer(p) for p in (sp_tokenizer_path, llama3_tokenizer_path, codellama_tokenizer_path))
    assert type(chat_format_for(sp)) is Llama2ChatFormat and type(chat_format_for(tt)) is Llama3ChatFormat
    assert type(chat_format_for(cl)) is Llama2ChatFormat  # Code Llama's files do not tell 70B-Instruct apart
    assert type(chat_format_for(sp, "llama2")) is Llama2ChatFormat
    assert type(chat_format_for(tt, "llama3")) is Llama3ChatFormat
    with pytest.raises(ValueError, match="<step> token"):
        chat_format_for(sp, "codellama-70b-instruct")
    with pytest.raises(ValueError, match="SentencePiece"):
        chat_format_for(tt, "codellama-70b-instruct")
    with pytest.raises(ValueError, match="tiktoken"):
        chat_format_for(sp, "llama3")
    with pytest.raises(ValueError, match="unknown chat format"):
        chat_format_for(sp, "chatml")


# --- Llama 3: llama-models' dialog rules ------------------------------------------------


@pytest.mark.parametrize(
    "dialog",
    [
        # Meta's documented custom-tool prompts are system, user, user
        [{"role": "system", "content": "s"}, {"role": "user", "content": "tools..."}, {"role": "user", "content": "q"}],
        # text is not stripped
        [{"role": "user", "content": "  spaces around \n"}],
        # "tool" is llama-models' (and OpenAI's) name for the ipython role
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "42"}],
    ],
)
def test_llama3_dialog_rules_match_meta(llama3_format, dialog):
    pytest.importorskip("llama_models")
    from llama_models.datatypes import RawMessage
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    meta = ChatFormat(Tokenizer.get_instance())
    expected = meta.encode_dialog_prompt([RawMessage(role=m["role"], content=m["content"]) for m in dialog]).tokens
    assert llama3_format.encode_dialog_prompt(dialog) == expected


def test_llama2_has_no_tool_calls(llama2_format):
    dialog = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "tool_calls": [{"tool_name": "f", "arguments": {}}]},
        {"role": "user", "content": "c"},
    ]
    with pytest.raises(ValueError, match="has no tool calls"):
        llama2_format.encode_dialog_prompt(dialog)
