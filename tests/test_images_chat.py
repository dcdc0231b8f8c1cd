"""Images in the example chat script: ``/image PATH`` in interactive chat and ``--image PATH`` for
the example dialogs, end to end on a tiny Llama 4 that sees (tests/vision_checkpoint.py): the script's ``main`` in
this process, its input piped in (tests/test_examples.py runs the script as processes).

What shows that a picture reached the model: each reply the script prints is the library's
greedy reply to the same dialog with that picture (``ChatSession.ask`` / ``chat_completion_stream``
in this process, on the same checkpoint), and those replies differ with another picture and
without one.  The quick tests read ``/image``'s checks without a model."""

from __future__ import annotations

import importlib.util
import io
import sys
from types import SimpleNamespace

import pytest

import helpers
from vision_checkpoint import picture_png, vision_checkpoint

QUESTION = "What is in the picture?"
MAX_SEQ_LEN = 128  # a reply room of 32 tokens (ChatSession's default: max_seq_len // 4)
RED, BLUE = (200, 30, 30), (30, 30, 200)


def load_example():
    """example_chat_completion.py as a module (importing it runs only its definitions)."""
    spec = importlib.util.spec_from_file_location("example_chat_completion",
                                                  helpers.REPO / "example_chat_completion.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- /image's checks, without a model ----------------------------------------------------------


@pytest.fixture(scope="module")
def example():
    return load_example()


def a_model(takes_images: bool):
    """What /image reads of a Llama: its chat format's image layout."""
    from llama.images.prompt import TileLayout

    return SimpleNamespace(formatter=SimpleNamespace(
        image_layout=TileLayout() if takes_images else None, why_no_images=lambda: "a text-only chat format"))


def test_image_command_attaches_the_files_bytes(example, tmp_path):
    raw = picture_png(RED)
    (tmp_path / "red.png").write_bytes(raw)
    assert example.shared_image(a_model(True), str(tmp_path / "red.png")) == raw


@pytest.mark.parametrize("case, says", [
    ("missing", "no file at"),
    ("folder", "is a directory, not an image file"),
    ("text", "is not a readable JPEG, PNG, WEBP or GIF image"),
    ("truncated", "truncated or corrupt"),
    ("empty", "say which image: /image PATH"),
])
def test_image_command_says_why_a_file_is_not_attached(example, tmp_path, case, says):
    path = {"missing": tmp_path / "nope.png", "folder": tmp_path, "text": tmp_path / "notes.txt",
            "truncated": tmp_path / "cut.png", "empty": ""}[case]
    (tmp_path / "notes.txt").write_text("not a picture")
    (tmp_path / "cut.png").write_bytes(picture_png(RED)[:200])
    why = example.shared_image(a_model(True), str(path))
    assert isinstance(why, str) and says in why, why


def test_image_command_on_a_text_only_model_says_so(example, tmp_path):
    (tmp_path / "red.png").write_bytes(picture_png(RED))
    why = example.shared_image(a_model(False), str(tmp_path / "red.png"))
    assert "this model takes no images" in why and "Llama 4" in why


def test_help_lists_the_chat_commands(example):
    for command in ("/image PATH", "/reset", "/help", "Ctrl-D"):
        assert command in example.CHAT_HELP


# -- the script end to end ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pictures")
    paths = {}
    for name, color in (("red", RED), ("blue", BLUE)):
        paths[name] = folder / f"{name}.png"
        paths[name].write_bytes(picture_png(color))
    (folder / "notes.txt").write_text("not a picture")
    return paths


@pytest.fixture(scope="module")
def seeing(tmp_path_factory):
    """(the checkpoint, the Llama built from it in this process as the script builds it)."""
    from llama import Llama

    ckpt = vision_checkpoint(tmp_path_factory)
    llama = Llama.build(ckpt.ckpt_dir, max_seq_len=MAX_SEQ_LEN, max_batch_size=1, device="cpu", dtype="float32")
    assert llama.formatter.image_layout is not None
    return ckpt, llama


def example_output(monkeypatch, capsys, argv: list[str], stdin: str = "") -> str:
    """The standard output of example_chat_completion.py's ``main`` run in this process on ``argv``,
    ``stdin`` its piped input (a process of its own per run was another import of torch;
    tests/test_examples.py runs the script as processes).  With the root_logger_kept fixture:
    ``main`` sets the root logger up as the script does."""
    example = load_example()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
    capsys.readouterr()
    example.main(example.parse_args(argv))
    return capsys.readouterr().out


@pytest.fixture
def run_example(monkeypatch, capsys, root_logger_kept):
    """run_example(ckpt, *args, stdin=...): :func:`example_output` on this file's checkpoint and settings."""
    def run(ckpt, *args: str, stdin: str = "") -> str:
        return example_output(monkeypatch, capsys, [
            "--ckpt_dir", str(ckpt.ckpt_dir), "--device", "cpu", "--dtype", "float32", "--temperature", "0",
            "--max_seq_len", str(MAX_SEQ_LEN), *args], stdin)

    return run


def session_reply(llama, *images: bytes) -> str:
    """The library's greedy reply to QUESTION with ``images``, in a new conversation."""
    from llama.formats.session import ChatSession

    return "".join(ChatSession(llama).ask(QUESTION, images=images, temperature=0))


@pytest.mark.slow  # loads the model twice (the script's own build)
def test_image_command_in_interactive_chat(seeing, pictures, run_example):
    """/help, /image with a missing file and a file that is no picture (refused, the chat goes
    on), /image with a picture then a question (the reply is the library's with that picture),
    the same with another picture, and the question alone: three different replies."""
    ckpt, llama = seeing
    lines = ["/help", f"/image {pictures['red'].parent / 'nope.png'}", f"/image {pictures['red'].parent / 'notes.txt'}",
             f"/image {pictures['red']}", QUESTION, "/reset", f"/image {pictures['blue']}", QUESTION, "/reset",
             QUESTION]
    out = run_example(ckpt, "--interactive", stdin="\n".join(lines) + "\n")
    assert "/image PATH   attach the picture at PATH" in out  # /help
    assert "(no image attached: no file at" in out and "notes.txt: " in out
    assert out.count("(image attached to your next message: 1 so far)") == 2
    red, blue, text = (session_reply(llama, pictures["red"].read_bytes()),
                       session_reply(llama, pictures["blue"].read_bytes()), session_reply(llama))
    assert len({red, blue, text}) == 3  # the picture changes the reply (else this test could not fail)
    first, second, third = out.split("(conversation cleared)")
    assert f"Assistant: {red}\n" in first
    assert f"Assistant: {blue}\n" in second
    assert f"Assistant: {text}\n" in third and out.rstrip().endswith("Bye.")


@pytest.mark.slow  # loads the model twice (the script's own build)
def test_image_flag_reaches_the_model(seeing, pictures, run_example):
    """``--image PATH``: each example dialog's reply is the library's greedy reply to that dialog
    with the picture before the text of its first user message, which is not its reply without it."""
    ckpt, llama = seeing
    out = run_example(ckpt, "--image", str(pictures["red"]), "--max_gen_len", "8")
    blocks = out.split("==================================")
    assert len(blocks) == 4, out  # three dialogs, then the tool example's line
    red = pictures["red"].read_bytes()
    for dialog, block in zip(example_dialogs(), blocks):
        assert block.count(f"[image {pictures['red']}]") == 1, block
        first = next(i for i, m in enumerate(dialog) if m["role"] == "user")
        parts = [{"type": "image", "image": red}, {"type": "text", "text": dialog[first]["content"]}]
        with_image = [*dialog[:first], {"role": "user", "content": parts}, *dialog[first + 1:]]
        expected = "".join(llama.chat_completion_stream(with_image, temperature=0, max_gen_len=8))
        assert f"> Assistant: {expected}\n" in block
        assert expected != "".join(llama.chat_completion_stream(dialog, temperature=0, max_gen_len=8))


def example_dialogs() -> list[list[dict]]:
    """The script's three example dialogs, written out again."""
    return [
        [{"role": "user", "content": "What should I pack for a weekend of hiking?"}],
        [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
        [{"role": "user", "content": "Suggest a name for a grey cat."},
         {"role": "assistant", "content": "How about Pebble?"},
         {"role": "user", "content": "Something longer, please."}],
    ]

