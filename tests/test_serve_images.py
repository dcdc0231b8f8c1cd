"""Images in chat requests (llama/serve/media.py, the image_url parts of llama/serve/openai_api.py)
against the fake engine: a data-URI image reaching the engine as the prompt tokens and images the
Llama 4 chat format gives for the same picture (raw HTTP and the official ``openai`` client,
streamed and not), every refusal as a 400 naming its part, the limits, and the allow-lists for
remote URLs (a local HTTP server) and local files.  Also the Python API's content parts and the
refusal of images by an engine whose model has no vision encoder."""

from __future__ import annotations

import base64
import http.server
import io
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from fake_engine import FakeEngine, served_model
from helpers import REPO
from llama.engine.core import IMAGES_NOT_TAKEN, Engine
from llama.formats.chat import Llama2ChatFormat, Llama4ChatFormat
from llama.images.prompt import PromptImage, TileLayout
from llama.serve.limits import MediaLimits
from llama.tokenizer import load_tokenizer

llama_models = pytest.importorskip("llama_models")
LLAMA4_TOKENIZER = Path(llama_models.__file__).parent / "llama4" / "tokenizer.model"
MODEL = "images-test"


def png(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (height * width * 3,), dtype=torch.uint8, generator=g).numpy().tobytes()
    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), data).save(buf, format=fmt)
    return buf.getvalue()


ONE_TILE = png(60, 40, seed=1)  # one tile: 144 <|patch|> tokens
WIDE = png(400, 150, seed=2)  # (1, 2) tiles and the global tile


def data_uri(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(raw).decode()


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def ask(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]


@pytest.fixture(scope="module")
def tokenizer4():
    from llama.serve.serving import longest_token_chars

    tokenizer = load_tokenizer(LLAMA4_TOKENIZER)
    longest_token_chars(tokenizer)  # read once from its 200k tokens (the server does at start), not in a test
    return tokenizer


@pytest.fixture(scope="module")
def vision_format(tokenizer4):
    return Llama4ChatFormat(tokenizer4, TileLayout())  # Scout's and Maverick's layout


@pytest.fixture
def engine(tokenizer4):
    engine = FakeEngine(tokenizer4, max_batch_size=4, max_seq_len=4096, max_queue=8)
    yield engine
    engine.close()


@pytest.fixture
def make_client(engine, vision_format):
    """A test client over the fake engine: ``formatter`` (default: Llama 4 with a layout) and
    ``media`` (default limits: data URIs only)."""
    from fastapi.testclient import TestClient

    from llama.serve import create_app

    clients = []

    def make(formatter=None, media=None):
        app = create_app(served_model(engine, formatter or vision_format), MODEL, media=media)
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def post(client, messages, **body):
    return client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "temperature": 0,
                                                     **body})


def check_400(response, param: str, *words: str) -> str:
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    for word in words:
        assert word in err["message"], err["message"]
    return err["message"]


def expected_prompt(vision_format, *images: bytes):
    """What the chat format itself makes of the same dialog with the images as bytes."""
    dialog = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                           *({"type": "image", "image": raw} for raw in images)]}]
    return vision_format.encode_dialog(dialog)


def check_submitted(engine, expected) -> None:
    (req,) = engine.submitted
    assert req.prompt_tokens == expected.tokens
    assert [im.digest for im in req.images] == [im.digest for im in expected.images]
    assert [im.patch_positions for im in req.images] == [im.patch_positions for im in expected.images]


# -- an image reaching the engine --------------------------------------------------------------------


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_data_uri_reaches_the_engine_as_the_formats_prompt(make_client, engine, vision_format):
    client = make_client()
    r = post(client, ask(image_part(data_uri(ONE_TILE), detail="high"), image_part(data_uri(WIDE))))
    assert r.status_code == 200, r.text
    expected = expected_prompt(vision_format, ONE_TILE, WIDE)
    assert [im.grid for im in expected.images] == [(1, 1), (1, 2)]  # the two layouts: one tile, and a grid
    check_submitted(engine, expected)
    assert r.json()["usage"]["prompt_tokens"] == len(expected.tokens)


@pytest.mark.slow  # importing the openai client takes seconds
@pytest.mark.parametrize("stream", [False, True])
def test_openai_client(make_client, engine, vision_format, stream):
    openai = pytest.importorskip("openai")
    client = make_client()
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    messages = ask(image_part(data_uri(ONE_TILE)))
    if stream:
        pieces = [c.choices[0].delta.content or "" for c in api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, temperature=0, stream=True) if c.choices]
        text = "".join(pieces)
    else:
        text = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                           temperature=0).choices[0].message.content
    assert text  # the fake engine's script
    check_submitted(engine, expected_prompt(vision_format, ONE_TILE))
    with pytest.raises(openai.BadRequestError, match="base64"):
        api.chat.completions.create(model=MODEL, messages=ask(image_part("data:image/png;base64,@@@")), max_tokens=3)


def test_text_parts_alone_are_one_string(make_client, engine, vision_format):
    client = make_client()
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert post(client, [{"role": "user", "content": parts}]).status_code == 200
    expected = vision_format.encode_dialog([{"role": "user", "content": "Hello there"}])
    assert engine.submitted[0].prompt_tokens == expected.tokens and engine.submitted[0].images == []


def test_props_say_whether_the_model_takes_images(make_client, tokenizer4):
    assert make_client().get("/props").json()["images"] is True
    props = make_client(Llama4ChatFormat(tokenizer4), MediaLimits(max_images_per_request=3)).get("/props").json()
    assert props["images"] is False and props["max_images_per_request"] == 3


# -- refusals ------------------------------------------------------------------------------------------


TRUNCATED = ONE_TILE[: len(ONE_TILE) // 2]
BMP = png(20, 20, fmt="BMP")


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,not*base64!", ["base64 is not valid"]),
    ("data:image/png," + "abc", ["base64-encoded"]),
    ("data:text/plain;base64,aGVsbG8=", ["not an image"]),
    ("data:image/png;base64,", ["empty"]),
    (data_uri(b"hello, not a picture"), ["not a readable"]),
    (data_uri(BMP, "image/bmp"), ["not a readable"]),  # a format the model's preprocessing does not read
    (data_uri(TRUNCATED), ["truncated"]),
    ("ftp://example.com/a.png", ["not ftp:"]),
    ("https://example.com/a.png", ["not fetched from 'example.com'", "--allowed_media_domains", "(none)"]),
    ("file:///etc/hostname", ["--allowed_local_media_path"]),
    ("/etc/hostname", ["--allowed_local_media_path"]),
])
def test_bad_images_are_400s_naming_the_part(make_client, engine, url, words):
    r = post(make_client(), ask(image_part(url)))
    message = check_400(r, "messages.0.content.1", *words)
    assert message.startswith("messages[0].content[1]: ")
    assert engine.submitted == []


def test_malformed_parts(make_client):
    client = make_client()
    check_400(post(client, ask({"type": "image_url"})), "messages.0.content.1", "image_url")
    check_400(post(client, ask({"type": "image_url", "image_url": {"url": 5}})), "messages.0.content.1")
    check_400(post(client, ask(image_part(data_uri(ONE_TILE), detail="huge"))), "messages.0.content.1", "detail")
    check_400(post(client, ask({"type": "input_audio", "input_audio": {}})), "messages.0.content.1",
              "'text' or 'image_url'")
    check_400(post(client, ask({"type": "text"})), "messages.0.content.1", "text")


def test_image_to_a_text_only_model(make_client, tokenizer4, engine):
    demo = load_tokenizer(REPO / "demo" / "tokenizer.model")
    for formatter in (Llama4ChatFormat(tokenizer4), Llama2ChatFormat(demo)):
        r = post(make_client(formatter), ask(image_part(data_uri(ONE_TILE))))
        check_400(r, "messages.0.content.1", "this model takes no images")
    assert engine.submitted == []


@pytest.mark.parametrize("role", ["system", "assistant"])
def test_image_outside_a_user_message(make_client, role):
    messages = [{"role": role, "content": [image_part(data_uri(ONE_TILE))]}, {"role": "user", "content": "Hi"}]
    if role == "assistant":
        messages.insert(0, {"role": "user", "content": "Look"})
    i = 1 if role == "assistant" else 0
    check_400(post(make_client(), messages), f"messages.{i}.content.0", f"a '{role}' message", "user messages")


def test_the_engine_refuses_images_it_cannot_use(make_client, engine):
    """An engine whose model has no vision encoder refuses a prompt with images: a ValueError, which
    the server answers as a 400 (never a prompt whose images were dropped)."""
    image = PromptImage(torch.zeros(1, 3, 336, 336), (1, 1), 0, 146, tuple(range(1, 145)))
    text_only = SimpleNamespace(model=SimpleNamespace(takes_images=False))
    with pytest.raises(ValueError, match="this model takes no images"):
        Engine.check_images(text_only, [image], 200)  # type: ignore[arg-type]

    def refuse(prompt_tokens, settings, on_event=None, *, images=()):
        if images:
            raise ValueError(IMAGES_NOT_TAKEN)
        return FakeEngine.submit(engine, prompt_tokens, settings, on_event)

    engine.submit = refuse
    r = post(make_client(), ask(image_part(data_uri(ONE_TILE))))
    assert r.status_code == 400 and "this model takes no images" in r.json()["error"]["message"], r.text
    assert post(make_client(), [{"role": "user", "content": "text only"}]).status_code == 200


# -- limits --------------------------------------------------------------------------------------------


def test_images_per_request(make_client, engine):
    client = make_client(media=MediaLimits(max_images_per_request=2))
    three = [image_part(data_uri(ONE_TILE))] * 3
    check_400(post(client, ask(*three)), "messages.0.content.3", "3 images", "(2, --max_images_per_request)")
    messages = ask(*three[:1]) + [{"role": "assistant", "content": "A picture."}] + ask(*three[:1])
    assert post(client, messages).status_code == 200  # two, over two messages
    assert len(engine.submitted[0].images) == 2


def test_bytes_per_image(make_client):
    limit = len(ONE_TILE) - 1
    client = make_client(media=MediaLimits(max_image_bytes=limit))
    check_400(post(client, ask(image_part(data_uri(ONE_TILE)))), "messages.0.content.1", "--max_image_bytes")
    assert post(make_client(media=MediaLimits(max_image_bytes=len(ONE_TILE))),
                ask(image_part(data_uri(ONE_TILE)))).status_code == 200
    huge = "data:image/png;base64," + "A" * (4 * limit)  # refused before it is decoded
    check_400(post(client, ask(image_part(huge))), "messages.0.content.1", "--max_image_bytes")


def test_pixels_per_image(make_client):
    client = make_client(media=MediaLimits(max_image_pixels=60 * 40 - 1))
    check_400(post(client, ask(image_part(data_uri(ONE_TILE)))), "messages.0.content.1", "60 x 40",
              "--max_image_pixels")
    assert post(make_client(media=MediaLimits(max_image_pixels=60 * 40)),
                ask(image_part(data_uri(ONE_TILE)))).status_code == 200


def test_limits_are_checked(tmp_path):
    with pytest.raises(ValueError, match="max_images_per_request"):
        MediaLimits(max_images_per_request=0)
    with pytest.raises(ValueError, match="host names"):
        MediaLimits(allowed_media_domains=("https://example.com",))
    with pytest.raises(ValueError, match="not a folder"):
        MediaLimits(allowed_local_media_path=str(tmp_path / "missing"))


def test_flags(tmp_path):
    from llama.serve.server import _parser, media_limits

    args = _parser().parse_args(["--max-images-per-request", "2", "--max_image_bytes", "1000",
                                 "--max-image-pixels", "5000", "--allowed-media-domains", "a.example, B.example.",
                                 "--allowed_local_media_path", str(tmp_path)])
    assert media_limits(args) == MediaLimits(2, 1000, 5000, ("a.example", "b.example"), str(tmp_path))
    assert media_limits(_parser().parse_args([])) == MediaLimits()  # the defaults: data URIs only


# -- local files -----------------------------------------------------------------------------------------


@pytest.fixture
def media_root(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "cat.png").write_bytes(ONE_TILE)
    (tmp_path / "secret.png").write_bytes(ONE_TILE)  # outside the folder
    os.symlink(tmp_path / "secret.png", root / "link.png")
    return root


def test_local_files_under_the_allowed_folder(make_client, engine, vision_format, media_root):
    client = make_client(media=MediaLimits(allowed_local_media_path=str(media_root)))
    for url in (f"file://{media_root}/sub/cat.png", str(media_root / "sub" / "cat.png"), "sub/cat.png",
                f"file://{media_root}/sub/../sub/cat.png"):
        assert post(client, ask(image_part(url))).status_code == 200, url
    assert len(engine.submitted) == 4
    assert engine.submitted[0].prompt_tokens == expected_prompt(vision_format, ONE_TILE).tokens


def test_local_escapes_are_refused(make_client, engine, media_root):
    client = make_client(media=MediaLimits(allowed_local_media_path=str(media_root)))
    secret = media_root.parent / "secret.png"
    for url in (f"file://{secret}", str(secret), "../secret.png", f"file://{media_root}/../secret.png",
                "link.png",  # a symbolic link out of the folder
                "sub/missing.png", f"file://otherhost{media_root}/sub/cat.png", "sub"):
        r = post(client, ask(image_part(url)))
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.1", (url, r.text)
    assert engine.submitted == []


# -- remote URLs -----------------------------------------------------------------------------------------


class _Images(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).hits.append(self.path)
        if self.path == "/cat.png":
            self._send(200, ONE_TILE)
        elif self.path == "/big.png":
            self._send(200, ONE_TILE + b"\0" * 100)
        elif self.path == "/slow.png":  # a byte every 50 ms
            self.send_response(200)
            self.send_header("Content-Length", str(len(ONE_TILE)))
            self.end_headers()
            for k in range(len(ONE_TILE)):
                try:
                    self.wfile.write(ONE_TILE[k:k + 1])
                    self.wfile.flush()
                except OSError:  # the client gave up
                    return
                time.sleep(0.05)
        elif self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def no_proxy(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_remote_urls_of_listed_hosts_are_fetched(make_client, engine, vision_format, image_server, no_proxy):
    _Images.hits.clear()
    client = make_client(media=MediaLimits(allowed_media_domains=("127.0.0.1",), max_image_bytes=len(ONE_TILE) + 50))
    assert post(client, ask(image_part(f"{image_server}/cat.png"))).status_code == 200
    check_submitted(engine, expected_prompt(vision_format, ONE_TILE))
    check_400(post(client, ask(image_part(f"{image_server}/big.png"))), "messages.0.content.1", "--max_image_bytes")
    check_400(post(client, ask(image_part(f"{image_server}/redirect"))), "messages.0.content.1", "redirect")
    check_400(post(client, ask(image_part(f"{image_server}/missing.png"))), "messages.0.content.1", "HTTP 404")
    assert _Images.hits == ["/cat.png", "/big.png", "/redirect", "/missing.png"]  # the redirect not followed


def test_a_slow_remote_image_is_given_up(make_client, image_server, no_proxy):
    """The fetch's time limit bounds the whole download, not each read (which a server sending a
    byte at a time would renew forever)."""
    client = make_client(media=MediaLimits(allowed_media_domains=("127.0.0.1",), fetch_timeout_s=0.3))
    start = time.monotonic()
    check_400(post(client, ask(image_part(f"{image_server}/slow.png"))), "messages.0.content.1", "longer than 0.3 s")
    assert time.monotonic() - start < 2


def test_remote_urls_of_other_hosts_are_never_fetched(make_client, engine, image_server, no_proxy):
    _Images.hits.clear()
    port = image_server.rsplit(":", 1)[1]
    client = make_client(media=MediaLimits(allowed_media_domains=("images.example",)))
    for url in (f"{image_server}/cat.png", f"http://localhost:{port}/cat.png",
                f"http://127.0.0.1.images.example:{port}/cat.png", f"http://images.example@127.0.0.1:{port}/cat.png"):
        check_400(post(client, ask(image_part(url))), "messages.0.content.1", "--allowed_media_domains")
    assert _Images.hits == [] and engine.submitted == []


# -- the Python API ----------------------------------------------------------------------------------------


def fake_llama(engine, formatter):
    from llama import Llama
    from llama.structured import StructuredOutputs

    llama = Llama.__new__(Llama)
    llama._hold(SimpleNamespace(  # type: ignore[arg-type]
        model=SimpleNamespace(params=SimpleNamespace(max_seq_len=engine.max_seq_len, max_batch_size=4)),
        tokenizer=engine.tokenizer, formatter=formatter, generator=torch.Generator(), policy=None, engine=engine,
        structured=StructuredOutputs(engine.tokenizer, compile_timeout_s=None)))
    return llama


def test_python_api_content_parts(engine, tokenizer4, vision_format):
    from llama_models.datatypes import RawMediaItem, RawTextItem

    text_only = fake_llama(engine, Llama4ChatFormat(tokenizer4))
    parts = [{"type": "text", "text": "Hello "}, RawTextItem(text="there")]
    reply = text_only.chat_completion([[{"role": "user", "content": parts}]], temperature=0, max_gen_len=3)
    assert reply[0]["generation"]["role"] == "assistant"
    assert engine.submitted[0].prompt_tokens == vision_format.encode_dialog(
        [{"role": "user", "content": "Hello there"}]).tokens
    for image in ({"type": "image", "image": ONE_TILE}, RawMediaItem(data=io.BytesIO(ONE_TILE))):
        with pytest.raises(ValueError, match="dialog 0: message 0 holds an image, but this model takes no images"):
            text_only.chat_completion([[{"role": "user", "content": [image, {"type": "text", "text": "?"}]}]])
        with pytest.raises(ValueError, match="takes no images"):
            text_only.chat_completion_stream([{"role": "user", "content": [image]}])
    assert len(engine.submitted) == 1
    # a model that takes images: the engine gets the prompt's images with its tokens
    dialog = [{"role": "user", "content": [{"type": "image", "image": Image.open(io.BytesIO(ONE_TILE))}]}]
    fake_llama(engine, vision_format).chat_completion([dialog], max_gen_len=3)
    expected = vision_format.encode_dialog([{"role": "user", "content": [{"type": "image", "image": ONE_TILE}]}])
    (image,) = engine.submitted[1].images
    assert engine.submitted[1].prompt_tokens == expected.tokens
    assert image.patch_positions == expected.images[0].patch_positions and image.digest == expected.images[0].digest


# -- the chat page, in headless Chromium --------------------------------------------------------------------


@pytest.mark.slow  # a browser and a real HTTP server
def test_the_chat_page_sends_a_pasted_picture(engine, vision_format, tmp_path):
    """A picture pasted into the message box is shown before sending and as a thumbnail in the
    user's message, and reaches the engine as the chat format's prompt for that image and text."""
    import socket

    import uvicorn
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from llama.serve import create_app
    from test_serve_process import headless_chromium

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(served_model(engine, vision_format), MODEL), lifespan="off",
                                           log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        with headless_chromium(tmp_path) as driver:
            driver.get(f"http://127.0.0.1:{sock.getsockname()[1]}/")
            wait = WebDriverWait(driver, 30)
            wait.until(lambda d: d.find_element(By.ID, "attach").is_displayed())
            driver.execute_script("""
                const bytes = Uint8Array.from(atob(arguments[0]), c => c.charCodeAt(0));
                const data = new DataTransfer();
                data.items.add(new File([bytes], "cat.png", { type: "image/png" }));
                document.getElementById("input").dispatchEvent(
                    new ClipboardEvent("paste", { clipboardData: data, bubbles: true, cancelable: true }));
            """, base64.b64encode(ONE_TILE).decode())
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#attachments img"))
            driver.find_element(By.ID, "input").send_keys("What is this?")
            driver.find_element(By.ID, "send").click()
            wait.until(lambda d: [e.get_attribute("data-state") for e in d.find_elements(
                By.CSS_SELECTOR, ".msg.assistant")] == ["done"])
            thumbs = driver.find_elements(By.CSS_SELECTOR, ".msg.user .thumbs img")
            assert len(thumbs) == 1 and thumbs[0].get_attribute("src") == data_uri(ONE_TILE)
            assert not driver.find_elements(By.CSS_SELECTOR, "#attachments img")  # sent: none pending
    finally:
        server.should_exit = True
        thread.join(10)
    expected = vision_format.encode_dialog([{"role": "user", "content": [
        {"type": "image", "image": ONE_TILE}, {"type": "text", "text": "What is this?"}]}])
    check_submitted(engine, expected)
