"""The chat page's side of the server, without a browser: ``GET /props`` (the model, the sampling
defaults a request gets, suggestions that fit the model, behind the API key), the suggestions
chosen for the bundled demo model and for any other, and the page file itself (one file that
fetches nothing from elsewhere and never turns text into HTML).  The page in headless Chromium:
test_serve.py (a real model) and test_serve_process.py (the fake engine, an API key)."""

from __future__ import annotations

import re

import pytest

from fake_engine import FakeEngine, served_model
from helpers import REPO
from llama.serve.page import DEMO_SUGGESTIONS, GENERIC_SUGGESTIONS, chat_suggestions

testclient = pytest.importorskip("fastapi.testclient")

PAGE = REPO / "llama" / "serve" / "static" / "chat.html"


@pytest.fixture(scope="module")
def engine():
    from llama.tokenizer import load_tokenizer

    engine = FakeEngine(load_tokenizer(REPO / "demo" / "tokenizer.model"), max_batch_size=2, max_seq_len=256)
    yield engine
    engine.close()


def test_the_demo_gets_shakespeare_and_any_other_model_generic_suggestions(tmp_path):
    demo = REPO / "demo"
    assert chat_suggestions(demo) == DEMO_SUGGESTIONS
    assert chat_suggestions(demo / ".." / "demo") == DEMO_SUGGESTIONS  # the same folder, spelt otherwise
    (tmp_path / "Llama3.2-1B-Instruct").mkdir()
    assert chat_suggestions(tmp_path / "Llama3.2-1B-Instruct") == GENERIC_SUGGESTIONS
    assert chat_suggestions(None) == GENERIC_SUGGESTIONS
    assert not set(DEMO_SUGGESTIONS) & set(GENERIC_SUGGESTIONS)


def test_props_gives_the_model_its_defaults_and_suggestions(engine):
    from llama.engine.requests import RequestSettings
    from llama.serve import create_app

    app = create_app(served_model(engine), "fake", chat_suggestions=DEMO_SUGGESTIONS)
    with testclient.TestClient(app) as client:
        props = client.get("/props").json()
        models = client.get("/v1/models").json()
    assert props["model"] == models["data"][0]["id"] == "fake"
    assert props["max_model_len"] == models["data"][0]["max_model_len"] == 256
    # what a request that names no sampling setting gets: the engine's own defaults (Meta's)
    settings = RequestSettings(max_new_tokens=1)
    assert props["defaults"] == {"temperature": settings.temperature, "top_p": settings.top_p}
    assert props["suggestions"] == list(DEMO_SUGGESTIONS)
    with testclient.TestClient(create_app(served_model(engine), "fake")) as client:
        assert client.get("/props").json()["suggestions"] == list(GENERIC_SUGGESTIONS)


def test_props_wants_the_api_key_the_page_does_not(engine):
    from llama.serve import create_app

    with testclient.TestClient(create_app(served_model(engine), "fake", api_keys=["k"])) as client:
        assert client.get("/").status_code == 200
        assert client.get("/props").status_code == 401
        assert client.get("/props", headers={"Authorization": "Bearer k"}).json()["model"] == "fake"


def test_the_page_fetches_nothing_from_elsewhere_and_writes_no_html():
    page = PAGE.read_text()
    # no CDN: every src/href/url()/import names this server's own paths (or none)
    for attr in re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", page):
        assert not re.match(r"^(?:[a-z]+:)?//", attr, re.I), attr
    assert not re.search(r"url\(\s*['\"]?(?:https?:)?//|@import|<link\b|<script\s+src", page, re.I)
    assert set(re.findall(r"""fetch\(\s*["']([^"']+)""", page)) == {"/props", "/v1/chat/completions"}
    # model text becomes nodes and textContent only
    script = page[page.index("<script>\n"):]
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "DOMParser", "createContextualFragment", "srcdoc"):
        assert sink not in script, sink


def test_the_page_attaches_pictures_only_where_the_model_takes_them(engine):
    """The page offers pictures (a file picker, paste, drop) only when ``/props`` says the model
    takes images, and sends each as OpenAI's image_url part with a data: URI; the demo model (Llama
    2's chat format, no vision layout) takes none.  The browser side of it is not run here."""
    from llama.serve import create_app

    with testclient.TestClient(create_app(served_model(engine), "fake")) as client:
        props = client.get("/props").json()
    assert props["images"] is False and props["max_images_per_request"] >= 1 and props["max_image_bytes"] >= 1
    page = PAGE.read_text()
    script = page[page.index("<script>\n"):]
    assert 'id="attach_file" type="file" accept="image/png,image/jpeg,image/webp,image/gif"' in page
    assert 'id="attach" type="button" hidden' in page  # shown only by loadModel, from /props
    assert 'takesImages = props.images === true' in script and '$("attach").hidden = !takesImages' in script
    for event in ('input.addEventListener("paste"', '$("form").addEventListener("drop"',
                  '$("attach_file").addEventListener("change"'):
        assert event in script, event
    assert 'type: "image_url", image_url: { url }' in script and "readAsDataURL" in script
    # a thumbnail's source is a data: URI of an image, never a URL the page would fetch
    assert 'url.startsWith("data:image/")' in script
