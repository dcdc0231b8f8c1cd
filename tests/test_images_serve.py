"""The server with a real engine and images: ``python -m llama.serve`` (one process) on a tiny
Llama 4 that sees (tests/vision_checkpoint.py), asked by the official ``openai`` client with
data-URI pictures, streamed and not.

Checked against this process's copy of the model: the replies are the library's greedy replies to
the same dialog with the same picture (so two pictures give two replies), the streamed text is the
whole one, and ``usage.prompt_tokens`` is the chat format's count, which is the text's own count
plus the image's tokens as Meta's format lays them out (one tile: ``<|image_start|><|image|>``, 16
``<|patch|>``, ``<|image_end|>``; a 1 x 2 grid: two tiles with a separator, the row's end, the
global tile after ``<|image|>``)."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import helpers
from vision_checkpoint import PATCHES_PER_TILE, TILE, picture_png, vision_checkpoint

pytestmark = pytest.mark.slow  # a server process and the model in this one (seconds)

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = "tiny-vision"
MAX_SEQ_LEN = 256
START_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 60  # a request hangs no test: the client gives up
QUESTION = "What is in this picture?"
RED, BLUE = picture_png((200, 30, 30)), picture_png((30, 30, 200))
WIDE = picture_png((30, 200, 30), (2 * TILE, TILE))  # a 1 x 2 grid of tiles and the global tile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_uri(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def openai_messages(raw: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                         {"type": "image_url", "image_url": {"url": data_uri(raw)}}]}]


def library_dialog(raw: bytes | None) -> list[dict]:
    """The same dialog in the Python API's shapes (the text, then the picture)."""
    if raw is None:
        return [{"role": "user", "content": QUESTION}]
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image", "image": raw}]}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(the server's URL, the Llama built here from the same checkpoint)."""
    from llama import Llama

    ckpt = vision_checkpoint(tmp_path_factory)
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve_images") / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(helpers.REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "llama.serve", "--ckpt_dir", str(ckpt.ckpt_dir), "--port", str(port),
           "--device", "cpu", "--dtype", "float32", "--max_seq_len", str(MAX_SEQ_LEN), "--max_batch_size", "2",
           "--model_name", MODEL]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=helpers.REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        llama = Llama.build(ckpt.ckpt_dir, max_seq_len=MAX_SEQ_LEN, max_batch_size=1, device="cpu", dtype="float32")
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
        yield url, llama
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture(scope="module")
def client(server):
    url, _ = server
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def ask(client, raw: bytes, stream: bool):
    """(text, usage) of a greedy 8-token chat about the picture ``raw``."""
    return helpers.openai_greedy_chat(client, MODEL, openai_messages(raw), stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_pictures_reach_the_model(server, client, stream):
    _, llama = server
    red, red_usage = ask(client, RED, stream)
    blue, _ = ask(client, BLUE, stream)
    expected_red = "".join(llama.chat_completion_stream(library_dialog(RED), temperature=0, max_gen_len=8))
    expected_blue = "".join(llama.chat_completion_stream(library_dialog(BLUE), temperature=0, max_gen_len=8))
    text_only = "".join(llama.chat_completion_stream(library_dialog(None), temperature=0, max_gen_len=8))
    assert len({expected_red, expected_blue, text_only}) == 3  # the picture changes the reply
    assert (red, blue) == (expected_red, expected_blue)
    assert red_usage.prompt_tokens == len(llama.formatter.encode_dialog(library_dialog(RED)).tokens)


def test_prompt_tokens_are_the_formats_count(server, client):
    """usage.prompt_tokens: the text's tokens plus the image's as the layout says (a tile is 16
    ``<|patch|>`` tokens), for one tile and for a grid of two."""
    _, llama = server
    text = len(llama.formatter.encode_dialog(library_dialog(None)).tokens)
    one_tile = 2 + PATCHES_PER_TILE + 1  # <|image_start|> <|image|> P <|image_end|>
    grid = 1 + (PATCHES_PER_TILE + 1 + PATCHES_PER_TILE) + 1 + 1 + PATCHES_PER_TILE + 1  # P <|tile_x|> P <|tile_y|>
    for raw, image_tokens in ((RED, one_tile), (WIDE, grid)):
        _, usage = ask(client, raw, stream=False)
        assert usage.prompt_tokens == text + image_tokens
        assert usage.prompt_tokens == len(llama.formatter.encode_dialog(library_dialog(raw)).tokens)
