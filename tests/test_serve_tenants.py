"""Tenants: API keys on the server, and a prefix cache that no client can probe for another's
prompts.  A real (tiny) model behind the HTTP app, its engine served on a thread as
``llama.serve`` serves it; hits are read from the engine's own count of reused prompt tokens."""

from __future__ import annotations

import threading

import pytest

from llama import Llama
from llama.serve import api_keys_from, cache_scope, create_app

KEYS = ["key-of-alice", "key-of-bob"]
SECRET = "The PIN of the safe is 7 and"


@pytest.fixture(scope="module")
def llama(llama3_checkpoint):
    ckpt, tok = llama3_checkpoint.ckpt_dir, llama3_checkpoint.tokenizer_path
    llama = Llama.build(ckpt, tok, max_seq_len=96, max_batch_size=4, device="cpu")
    stop = threading.Event()
    thread = threading.Thread(target=llama.engine.run_forever, args=(stop,), daemon=True)
    thread.start()
    yield llama
    stop.set()
    thread.join(30)


def make_client(llama, **kw):
    from fastapi.testclient import TestClient

    return TestClient(create_app(llama, "tiny", **kw))


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def cached_tokens(llama) -> int:
    return llama.engine.stats()["cached_prompt_tokens_total"]


def probe(client, key: str | None, prompt: str, **extra) -> int:
    """Prompt tokens the engine reused for this request (the side channel's signal)."""
    before = cached_tokens(client.app.state.llama)
    r = client.post("/v1/completions", headers=auth(key) if key else {},
                    json={"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return cached_tokens(client.app.state.llama) - before


@pytest.fixture(scope="module")
def keyed(llama):
    with make_client(llama, api_keys=KEYS) as c:
        c.app.state.llama = llama
        yield c


def test_every_v1_route_and_metrics_need_a_key(keyed):
    for method, path in [("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/v1/chat/completions"),
                         ("get", "/metrics"), ("get", "/v1/nothing")]:
        for headers in ({}, auth("wrong"), {"Authorization": "Basic " + KEYS[0]}, {"Authorization": "Bearer"}):
            r = getattr(keyed, method)(path, headers=headers, **({"json": {"prompt": "x"}} if method == "post" else {}))
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["message"]
            assert r.headers["www-authenticate"] == "Bearer"
    for key in KEYS:
        assert keyed.get("/v1/models", headers=auth(key)).status_code == 200
        assert keyed.get("/metrics", headers=auth(key)).status_code == 200


def test_health_says_only_whether_the_server_is_up(keyed):
    r = keyed.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_another_key_s_prompt_is_never_a_cache_hit(keyed):
    """Bob probes Alice's prompt (known prefix + guess): the engine reuses nothing across keys,
    while Alice's own next request does reuse her prefix (so the probe could have seen one)."""
    secret = SECRET + " the code is"
    probe(keyed, KEYS[0], secret + " 7")  # Alice's request: its prompt stays in the prefix cache
    assert probe(keyed, KEYS[1], secret + " 8") == 0
    assert probe(keyed, KEYS[0], secret + " 8") > 0


def test_different_salts_never_share_a_prefix(llama):
    with make_client(llama) as client:  # no keys: anyone may call
        client.app.state.llama = llama
        secret = SECRET + " the salt is"
        probe(client, None, secret + " 1", cache_salt="alice")
        assert probe(client, None, secret + " 2", cache_salt="bob") == 0
        assert probe(client, None, secret + " 3") == 0  # no salt is a scope of its own
        assert probe(client, None, secret + " 4", cache_salt="alice") > 0
        bad = client.post("/v1/completions", json={"prompt": "x", "cache_salt": ""})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_shared_prefix_cache_lets_keys_share(llama):
    with make_client(llama, api_keys=KEYS, shared_prefix_cache=True) as client:
        client.app.state.llama = llama
        probe(client, KEYS[0], SECRET + " shared")
        assert probe(client, KEYS[1], SECRET + " shared") > 0


def test_cache_scope_tells_keys_and_salts_apart():
    scopes = {cache_scope(k, s) for k in (None, b"alice-key", b"bob-key") for s in (None, "x", "y")}
    assert len(scopes) == 9 and None in scopes
    assert not any("alice-key" in s for s in scopes if s)  # the key itself never travels to the ranks


def test_api_keys_from_flags_and_environment():
    assert api_keys_from(["k1", "k2"], {"LLAMA_API_KEY": "other"}) == ["k1", "k2"]
    assert api_keys_from(None, {"LLAMA_API_KEY": "k1, k2,"}) == ["k1", "k2"]
    assert api_keys_from(None, {}) == []
    for bad in (["has space"], ["tab\tkey"], ["ключ"]):
        with pytest.raises(ValueError, match="API key"):
            api_keys_from(bad, {})


@pytest.mark.parametrize("listed", [",", "", " , ,"])
def test_a_key_list_that_names_no_key_refuses_to_start(listed):
    """LLAMA_API_KEY="," used to start an open server, with only a warning; now one line and
    status 1, before anything loads (the checkpoint named here does not exist)."""
    import os
    import subprocess
    import sys

    from helpers import REPO

    with pytest.raises(ValueError, match="LLAMA_API_KEY is set but names no key"):
        api_keys_from(None, {"LLAMA_API_KEY": listed})
    assert api_keys_from(["k1"], {"LLAMA_API_KEY": listed}) == ["k1"]  # the flag wins, as before
    env = {**os.environ, "LLAMA_API_KEY": listed, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "llama.serve", "--ckpt_dir", "/nowhere", "--port", "0"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out
    said = (f"llama-serve: error: LLAMA_API_KEY is set but names no key ({listed!r}): set it to one or more keys "
            "separated by commas, or unset it to serve without keys")
    assert out.stderr.strip().splitlines() == [said], out.stderr
