"""The chat and infilling calls wired to the formats: ``tools=`` reaches the prompt,
replies come back with ``stop_reason`` and ``tool_calls`` (batch and stream),
``text_infilling`` builds Code Llama's prompt and stops at <EOT>, and
``chat_format="codellama-70b-instruct"`` stops at <step>.

A random model does not call tools by itself, so a logits processor scripts its reply
token by token; what is checked is everything around the model: the prompt it was
given (seen by the processor), where generation stopped, and how the reply was read."""

from __future__ import annotations

import pytest
import torch

import helpers
from conftest import LLAMA2_PARAMS
from llama import Llama
from llama.formats.infilling import infilling_prompt_tokens
from llama.tokenizer import load_tokenizer

TOOLS = [
    "brave_search",
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "required": ["city"],
                                                     "properties": {"city": {"type": "string"}}}}},
]


class Script:
    """A logits processor that makes the model emit ``tokens`` in order (and records the
    token history it was shown at the first step: the prompt)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.prompt: list[int] | None = None

    def __call__(self, history: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.prompt is None:
            self.prompt = history[0].tolist()
        step = history.shape[1] - len(self.prompt)
        forced = torch.full_like(logits, float("-inf"))
        forced[:, self.tokens[min(step, len(self.tokens) - 1)]] = 0.0
        return forced


@pytest.fixture
def llama3(llama3_checkpoint) -> Llama:
    ckpt, tok = llama3_checkpoint.ckpt_dir, llama3_checkpoint.tokenizer_path
    return Llama.build(ckpt, tok, max_seq_len=1536, max_batch_size=2, device="cpu")  # the tool prompt is long in bytes


def special(llama: Llama, name: str) -> int:
    return llama.tokenizer.special_tokens[name]


def test_tools_reach_the_prompt_and_calls_come_back(llama3):
    dialog = [{"role": "user", "content": "Weather in Paris?"}]
    call = llama3.tokenizer.encode('brave_search.call(query="paris weather")', bos=False, eos=False)
    script = Script([special(llama3, "<|python_tag|>")] + call + [special(llama3, "<|eom_id|>")])
    reply = llama3.chat_completion([dialog], tools=TOOLS, temperature=0, logits_processor=script)[0]["generation"]
    assert script.prompt == llama3.formatter.encode_dialog_prompt(dialog, "json", tools=TOOLS)
    assert script.prompt != llama3.formatter.encode_dialog_prompt(dialog)  # the tools are declared
    assert reply["stop_reason"] == "end_of_message"
    assert [(c["tool_name"], c["arguments"]) for c in reply["tool_calls"]] == [("brave_search",
                                                                                {"query": "paris weather"})]
    # The reply goes back into the dialog as it is, with the tool's answer after it.
    follow_up = dialog + [reply, {"role": "ipython", "content": '{"results": []}'}]
    answer = Script(llama3.tokenizer.encode("Sunny.", bos=False, eos=False) + [special(llama3, "<|eot_id|>")])
    final = llama3.chat_completion([follow_up], tools=TOOLS, temperature=0, logits_processor=answer)[0]["generation"]
    assert final == {"role": "assistant", "content": "Sunny.", "stop_reason": "end_of_turn", "tool_calls": []}


def test_pythonic_calls_all_come_back_and_the_stream_reports_them(llama3):
    dialog = [{"role": "user", "content": "Paris and Rome?"}]
    text = '[get_weather(city="Paris"), get_weather(city="Rome")]'
    script = Script(llama3.tokenizer.encode(text, bos=False, eos=False) + [special(llama3, "<|eot_id|>")])
    stream = llama3.chat_completion_stream(dialog, tools=TOOLS[1:], tool_prompt_format="python_list",
                                           temperature=0, logits_processor=script)
    assert "".join(stream) == text
    assert stream.message["stop_reason"] == "end_of_turn"
    assert [c["arguments"]["city"] for c in stream.message["tool_calls"]] == ["Paris", "Rome"]
    batch = llama3.chat_completion([dialog], tools=TOOLS[1:], tool_prompt_format="python_list", temperature=0,
                                   logits_processor=Script(script.tokens))[0]["generation"]
    assert [c["arguments"] for c in batch["tool_calls"]] == [c["arguments"] for c in stream.message["tool_calls"]]


def test_out_of_tokens_and_plain_replies(llama3):
    reply = llama3.chat_completion([[{"role": "user", "content": "Hi"}]], max_gen_len=3, temperature=0,
                                   logits_processor=Script([5, 6, 7, 8]))[0]["generation"]
    assert reply["stop_reason"] == "out_of_tokens" and reply["tool_calls"] == []
    assert reply["content"] == llama3.tokenizer.decode([5, 6, 7])


def test_tools_refused_for_a_llama2_model(llama2_checkpoint):
    ckpt, tok = llama2_checkpoint.ckpt_dir, llama2_checkpoint.tokenizer_path
    llama = Llama.build(ckpt, tok, max_seq_len=64, max_batch_size=1, device="cpu")
    with pytest.raises(ValueError, match="Llama 3.1 or later"):
        llama.chat_completion([[{"role": "user", "content": "Hi"}]], tools=TOOLS)


@pytest.fixture
def codellama_checkpoint(tmp_path, codellama_tokenizer_path):
    vocab = load_tokenizer(codellama_tokenizer_path).n_words
    params = {**LLAMA2_PARAMS, "vocab_size": vocab}
    ckpt = helpers.write_checkpoint(tmp_path / "codellama", params, helpers.random_weights(params, vocab, seed=9),
                                    1, "dim")
    return ckpt, codellama_tokenizer_path


@pytest.mark.parametrize("suffix_first", [False, True])
def test_text_infilling(codellama_checkpoint, suffix_first):
    ckpt, tok = codellama_checkpoint
    llama = Llama.build(ckpt, tok, max_seq_len=128, max_batch_size=2, device="cpu")
    eot = llama.tokenizer.eot_id
    middle = llama.tokenizer.encode("return a + b", bos=False, eos=False)
    script = Script(middle + [eot, 5, 5])
    out = llama.text_infilling(["def add(a, b):\n    "], ["\n\nprint(add(1, 2))"], suffix_first=suffix_first,
                               logits_processor=script)[0]
    assert script.prompt == infilling_prompt_tokens(llama.tokenizer, "def add(a, b):\n    ", "\n\nprint(add(1, 2))",
                                                    suffix_first=suffix_first)
    assert out["generation"] == llama.tokenizer.decode_infilling(middle)  # stopped at <EOT>, nothing after it
    assert out["full_text"] == "def add(a, b):\n    " + out["generation"] + "\n\nprint(add(1, 2))"
    with pytest.raises(ValueError, match="one suffix per prefix"):
        llama.text_infilling(["a", "b"], ["c"])


def test_infilling_needs_a_code_llama_tokenizer(llama3):
    with pytest.raises(ValueError, match="infilling"):
        llama3.text_infilling(["a"], ["b"])


def test_codellama_70b_instruct_format_stops_at_step(codellama_checkpoint):
    ckpt, tok = codellama_checkpoint
    llama = Llama.build(ckpt, tok, max_seq_len=128, max_batch_size=1, device="cpu",
                        chat_format="codellama-70b-instruct")
    step = llama.tokenizer.step_id
    words = llama.tokenizer.encode("Hello there", bos=False, eos=False)
    script = Script(words + [step, 5, 5, 5])
    reply = llama.chat_completion([[{"role": "user", "content": "Hi"}]], temperature=0, logits_processor=script)
    assert reply[0]["generation"]["content"] == llama.tokenizer.decode(words)
    assert reply[0]["generation"]["stop_reason"] == "end_of_turn"
    assert script.prompt == llama.formatter.encode_dialog_prompt([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError):
        Llama.build(ckpt, tok, max_seq_len=128, max_batch_size=1, device="cpu", chat_format="llama4-nonsense")


# -- text stays text: calls come from token ids, and only declared tools are called ----------

LITERAL_TAG = "<|python_tag|>print(42)"  # the characters, not the control token


def text_tokens(llama: Llama, text: str) -> list[int]:
    return llama.tokenizer.encode(text, bos=False, eos=False)


def reply_to(llama: Llama, script: list[int], tools, **kw) -> dict:
    dialog = [{"role": "user", "content": "Go"}]
    batch = llama.chat_completion([dialog], tools=tools, temperature=0, logits_processor=Script(script), **kw)
    stream = llama.chat_completion_stream(dialog, tools=tools, temperature=0, logits_processor=Script(script), **kw)
    streamed = "".join(stream)

    def without_ids(message: dict) -> dict:
        return {**message, "tool_calls": [{**c, "call_id": None} for c in message["tool_calls"]]}

    assert without_ids(stream.message) == without_ids(batch[0]["generation"])
    assert streamed == batch[0]["generation"]["content"] or batch[0]["generation"]["tool_calls"]
    return batch[0]["generation"]


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@pytest.mark.parametrize("ending", ["stop token", "stop string", "length"])
def test_literal_python_tag_text_stays_text_in_every_ending(llama3, ending):
    """The model writes the characters ``<|python_tag|>print(42)``: text, even with
    code_interpreter declared (before, a stop string or the length limit read the decoded
    text and made it a code_interpreter call)."""
    script = text_tokens(llama3, LITERAL_TAG)
    kw: dict = {}
    if ending == "stop token":
        script = script + [special(llama3, "<|eom_id|>")]
    elif ending == "stop string":
        script = script + text_tokens(llama3, " END")
        kw["stop"] = ["END"]
    else:
        kw["max_gen_len"] = len(script)
        script = script + text_tokens(llama3, " more")
    for tools in (["code_interpreter"], TOOLS[1:]):
        reply = reply_to(llama3, script, tools, **kw)
        assert reply["tool_calls"] == []
        assert reply["content"].strip() == LITERAL_TAG


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_real_call_needs_its_tool_declared(llama3):
    tag, eom = special(llama3, "<|python_tag|>"), special(llama3, "<|eom_id|>")
    code = [tag] + text_tokens(llama3, "print(42)") + [eom]
    called = reply_to(llama3, code, ["code_interpreter"])
    assert [(c["tool_name"], c["arguments"]) for c in called["tool_calls"]] == [
        ("code_interpreter", {"code": "print(42)"})]
    for tools in (TOOLS[1:], None):  # only get_weather, or nothing declared: the reply is text
        reply = reply_to(llama3, code, tools)
        assert reply["tool_calls"] == [] and reply["content"] == "<|python_tag|>print(42)"
    search = [tag] + text_tokens(llama3, 'brave_search.call(query="x")') + [eom]
    assert reply_to(llama3, search, TOOLS[1:])["tool_calls"] == []
    undeclared = text_tokens(llama3, '{"type": "function", "name": "launch", "parameters": {"when": "now"}}')
    reply = reply_to(llama3, undeclared + [special(llama3, "<|eot_id|>")], TOOLS)
    assert reply["tool_calls"] == [] and reply["content"].startswith('{"type": "function", "name": "launch"')


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_call_cut_by_the_length_limit_is_text(llama3):
    call = text_tokens(llama3, '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    reply = reply_to(llama3, call + [special(llama3, "<|eot_id|>")], TOOLS, max_gen_len=len(call) - 3)
    assert reply["stop_reason"] == "out_of_tokens" and reply["tool_calls"] == []
    assert reply["content"] == llama3.tokenizer.decode(call[:-3])
    whole = reply_to(llama3, call + [special(llama3, "<|eot_id|>")], TOOLS)
    assert [c["tool_name"] for c in whole["tool_calls"]] == ["get_weather"]
    code = [special(llama3, "<|python_tag|>")] + text_tokens(llama3, "for i in range(10): print(i)")
    cut = reply_to(llama3, code, ["code_interpreter"], max_gen_len=5)
    assert cut["stop_reason"] == "out_of_tokens" and cut["tool_calls"] == []
    assert cut["content"] == llama3.tokenizer.decode(code[:5])
