"""LoRA adapters behind the OpenAI server: the request's ``model`` picks the adapter (the base's
id none), ``/v1/models`` lists the base and each adapter (its ``parent`` the base, as vLLM), an
unknown ``model`` is a 404 in OpenAI's shape; ``--lora NAME=PATH`` and its limits on the command
line.  The server runs in this process (the official ``openai`` client over FastAPI's test
client), on a random-weight Llama 3 serving in-memory adapters; its answers are checked against
the Python API's calls with the same adapters."""

from __future__ import annotations

import argparse
import threading

import pytest

import helpers
from lora_serve_helpers import ALL_TARGETS, random_adapter

BASE = "base-model"


@pytest.fixture(scope="module")
def llama(llama3_checkpoint):
    n = llama3_checkpoint.params["n_layers"]
    adapters = {
        "alpha": random_adapter("alpha", llama3_checkpoint.weights, n, 8, ALL_TARGETS, seed=1),
        "beta": random_adapter("beta", llama3_checkpoint.weights, n, 4, ALL_TARGETS[:4], seed=2, scale=0.5),
    }
    return helpers.build(llama3_checkpoint, max_seq_len=128, max_batch_size=4, compile=False, lora_adapters=adapters)


@pytest.fixture(scope="module")
def client(llama):
    """The official client, talking to the app in this process; the engine stepped by a thread
    of its own, as the server's main thread steps it."""
    import openai
    from fastapi.testclient import TestClient

    from llama.serve import create_app

    stop = threading.Event()
    stepping = threading.Thread(target=llama.engine.run_forever, args=(stop,), daemon=True)
    stepping.start()
    try:
        with TestClient(create_app(llama, BASE)) as http:
            yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    finally:
        stop.set()
        stepping.join(30)


@pytest.mark.slow  # a model served in this process: seconds to start
def test_models_lists_the_base_and_each_adapter(client):
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == [BASE, "alpha", "beta"]
    assert models["alpha"].model_extra["parent"] == BASE and models["beta"].model_extra["parent"] == BASE
    assert models[BASE].model_extra["parent"] is None
    assert models["alpha"].model_extra["root"] == "/in-memory/alpha"


@pytest.mark.slow  # a model served in this process: seconds to start
def test_model_field_picks_the_adapter(client, llama):
    """A completion and a chat reply with ``model`` an adapter's id are the Python API's with
    ``lora=`` that adapter; the base's id gives the base's; the answer names the model asked."""
    prompt = "the quick"
    for model, lora in ((BASE, None), ("alpha", "alpha"), ("beta", "beta")):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        expected = llama.text_completion([prompt], temperature=0, max_gen_len=6, lora=lora)[0]["generation"]
        assert r.choices[0].text == expected, model
        assert r.model == model
    texts = set()
    for model, lora in ((BASE, None), ("alpha", "alpha"), ("beta", "beta")):
        text, _ = helpers.openai_greedy_chat(client, model, [{"role": "user", "content": "hi"}], stream=False,
                                             max_tokens=6)
        expected = llama.chat_completion([[{"role": "user", "content": "hi"}]], temperature=0, max_gen_len=6,
                                         lora=lora)[0]["generation"]["content"]
        assert text == expected, model
        texts.add(text)
    assert len(texts) == 3  # the adapters change the reply


@pytest.mark.slow  # a model served in this process: seconds to start
def test_unknown_model_is_a_404(client):
    import openai

    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gamma", prompt="x", max_tokens=2)
    body = caught.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "'gamma' does not exist" in body["message"] and "'alpha'" in body["message"]


def _flags(*argv: str) -> argparse.Namespace:
    from llama.serve.server import _parser

    return _parser().parse_args(list(argv))


def test_lora_flags(tmp_path):
    from llama.serve.server import lora_options

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    args = _flags("--lora", f"one={tmp_path / 'a'}", "--lora", f"two={tmp_path / 'b'}", "--max_loras", "3",
                  "--max-lora-rank", "16")
    assert lora_options(args) == {"one": str(tmp_path / "a"), "two": str(tmp_path / "b")}
    assert (args.max_loras, args.max_lora_rank) == (3, 16)
    assert lora_options(_flags()) is None
    with pytest.raises(ValueError, match="give NAME=PATH"):
        lora_options(_flags("--lora", str(tmp_path / "a")))
    with pytest.raises(ValueError, match="'one' is given twice"):
        lora_options(_flags("--lora", f"one={tmp_path / 'a'}", "--lora", f"one={tmp_path / 'b'}"))
    with pytest.raises(FileNotFoundError, match="check --lora"):
        lora_options(_flags("--lora", f"one={tmp_path / 'missing'}"))
    with pytest.raises(ValueError, match="--max_loras limits the adapters of --lora"):
        lora_options(_flags("--max_loras", "2"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_served_peft_adapters_on_two_ranks(tmp_path, tiny_tiktoken_path):
    """``python -m llama.serve --lora NAME=PATH`` (twice) on two ranks, PEFT's own adapter files:
    the official client picks each adapter by ``model`` and gets the Python API's greedy text
    with that adapter (one process); ``/v1/models`` lists both; an unknown model is a 404."""
    pytest.importorskip("peft")
    import openai

    import lora_helpers as L
    from test_serve import Server

    hf_dir, hf_model = L.tiny_hf_llama(tmp_path / "hf", "llama3", seed=3, tokenizer_path=tiny_tiktoken_path)
    meta = L.meta_conversion(hf_dir, tmp_path / "meta")
    folders = {"sql": L.make_peft_adapter(hf_model, tmp_path / "sql", r=8, alpha=16, seed=1),
               "poet": L.make_peft_adapter(hf_model, tmp_path / "poet", r=16, alpha=8, use_rslora=True,
                                           target_modules=("q_proj", "v_proj", "down_proj"), seed=2)}
    reference = helpers.build((meta, tiny_tiktoken_path), max_seq_len=128, max_batch_size=2, compile=False,
                              lora_adapters={n: str(p) for n, p in folders.items()})
    server = Server(tmp_path / "server.log", "--ckpt_dir", str(meta), "--tokenizer_path", str(tiny_tiktoken_path),
                    "--model_name", BASE, "--max_seq_len", "128", "--max_batch_size", "4", "--no-compile",
                    *[arg for n, p in folders.items() for arg in ("--lora", f"{n}={p}")], "--max_lora_rank", "16")
    try:
        client = server.client()
        models = {m.id: m.model_extra.get("parent") for m in client.models.list().data}
        assert models == {BASE: None, "sql": BASE, "poet": BASE}
        texts = set()
        for model, lora in ((BASE, None), ("sql", "sql"), ("poet", "poet")):
            r = client.completions.create(model=model, prompt="the quick", max_tokens=6, temperature=0)
            expected = reference.text_completion(["the quick"], temperature=0, max_gen_len=6, lora=lora)
            assert r.choices[0].text == expected[0]["generation"], model
            texts.add(r.choices[0].text)
        assert len(texts) == 3
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    finally:
        server.kill()
