"""A Llama 3.2 Vision checkpoint served and chatted with: ``python -m llama.serve`` (one
process) asked by the official ``openai`` client with a data-URI picture, whole and streamed, and
``example_chat_completion.py --image``, on mllama_helpers' tiny random model with Llama 3's
vocabulary and tokenizer (tests/test_engine_mllama.py checks the library's replies against the
model called directly and transformers).

Checked against this process's copy of the model: the replies are the library's greedy replies to
the same dialog with the same picture (two pictures give two replies, and neither is the reply
without a picture), and ``usage.prompt_tokens`` is the chat format's count: the text's and one
``<|image|>`` token."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pytest

import helpers
from test_images_serve import REQUEST_TIMEOUT_S, START_TIMEOUT_S, data_uri, free_port

pytestmark = pytest.mark.slow  # a server process, the script and the model in this one (seconds)

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

MODEL = "tiny-mllama"
MAX_SEQ_LEN = 128
QUESTION = "What is in this picture?"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
       "PYTHONPATH": os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")])}


def picture_png(color: tuple[int, int, int], size: tuple[int, int] = (28, 28)) -> bytes:
    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 3):
        for y in range(0, size[1], 3):
            image.putpixel((x, y), ((x * 5) % 256, (y * 7) % 256, (x + y) % 256))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


RED, BLUE = picture_png((200, 30, 30)), picture_png((30, 30, 200), (56, 28))


def library_dialog(raw: bytes | None) -> list[dict]:
    if raw is None:
        return [{"role": "user", "content": QUESTION}]
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image", "image": raw}]}]


@pytest.fixture(scope="module")
def checkpoint(mllama_llama3_files):
    """(the checkpoint folder (conftest's, shared with tests/test_engine_mllama.py), the Llama built
    from it in this process)."""
    from llama import Llama

    ckpt = mllama_llama3_files[1] / "meta"
    llama = Llama.build(ckpt, max_seq_len=MAX_SEQ_LEN, max_batch_size=2, device="cpu", dtype="float32")
    assert llama.formatter.image_layout is not None
    return ckpt, llama


@pytest.fixture(scope="module")
def client(checkpoint, tmp_path_factory):
    ckpt, _ = checkpoint
    port = free_port()
    log_path = tmp_path_factory.mktemp("mllama_serve_log") / "server.log"
    cmd = [sys.executable, "-m", "llama.serve", "--ckpt_dir", str(ckpt), "--port", str(port), "--device", "cpu",
           "--dtype", "float32", "--max_seq_len", str(MAX_SEQ_LEN), "--max_batch_size", "2", "--model_name", MODEL]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=helpers.REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no /health in {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        assert httpx.get(url + "/props", timeout=5).json()["images"] is True
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def ask(client, raw: bytes, stream: bool):
    """(text, usage) of a greedy 8-token chat about the picture ``raw``."""
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                             {"type": "image_url", "image_url": {"url": data_uri(raw)}}]}]
    return helpers.openai_greedy_chat(client, MODEL, messages, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_pictures_reach_the_served_model(checkpoint, client, stream):
    _, llama = checkpoint
    red, red_usage = ask(client, RED, stream)
    blue, _ = ask(client, BLUE, stream)
    expected_red = "".join(llama.chat_completion_stream(library_dialog(RED), temperature=0, max_gen_len=8))
    expected_blue = "".join(llama.chat_completion_stream(library_dialog(BLUE), temperature=0, max_gen_len=8))
    text_only = "".join(llama.chat_completion_stream(library_dialog(None), temperature=0, max_gen_len=8))
    assert len({expected_red, expected_blue, text_only}) == 3  # the picture changes the reply
    assert (red, blue) == (expected_red, expected_blue)
    text_tokens = len(llama.formatter.encode_dialog(library_dialog(None)).tokens)
    assert red_usage.prompt_tokens == len(llama.formatter.encode_dialog(library_dialog(RED)).tokens) == text_tokens + 1


def test_example_image_flag_reaches_the_model(checkpoint, tmp_path, monkeypatch, capsys, root_logger_kept):
    """``example_chat_completion.py --image PATH``: each example dialog's reply is the library's
    greedy reply with the picture before the text of its first user message.  (The script's
    ``main`` in this process, as tests/test_images_chat.py runs it.)"""
    from test_images_chat import example_dialogs, example_output

    ckpt, llama = checkpoint
    path = tmp_path / "red.png"
    path.write_bytes(RED)
    out = example_output(monkeypatch, capsys, [
        "--ckpt_dir", str(ckpt), "--device", "cpu", "--dtype", "float32", "--temperature", "0", "--max_seq_len",
        str(MAX_SEQ_LEN), "--image", str(path), "--max_gen_len", "8"])
    blocks = out.split("==================================")
    assert len(blocks) == 4, out  # three dialogs, then the tool example's line
    for dialog, block in zip(example_dialogs(), blocks):
        assert block.count(f"[image {path}]") == 1, block
        first = next(i for i, m in enumerate(dialog) if m["role"] == "user")
        parts = [{"type": "image", "image": RED}, {"type": "text", "text": dialog[first]["content"]}]
        with_image = [*dialog[:first], {"role": "user", "content": parts}, *dialog[first + 1:]]
        expected = "".join(llama.chat_completion_stream(with_image, temperature=0, max_gen_len=8))
        assert f"> Assistant: {expected}\n" in block
        assert expected != "".join(llama.chat_completion_stream(dialog, temperature=0, max_gen_len=8))
