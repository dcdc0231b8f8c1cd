"""The engine's message protocol (llama.serve.engine_process): its messages round-trip, and an
EngineClient talking to an EngineBridge over a real socket pair (with the fake engine, in this
process) gives each request the events the engine emitted, cancels, counts what is in flight,
and fails every request at once when the engine's end goes away."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import threading
from multiprocessing.connection import Connection
from types import SimpleNamespace

import pytest

import helpers
from fake_engine import FakeEngine
from llama.engine import EngineStopped, RequestResult, RequestSettings, TokenEvent
from llama.serve.engine_process import EngineBridge, EngineClient, EngineDied, decode, encode, grammar_source
from llama.tokenizer import load_tokenizer

TIMEOUT_S = 10


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(helpers.REPO / "demo" / "tokenizer.model")


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no")


def test_messages_round_trip():
    settings = RequestSettings(max_new_tokens=5, temperature=0.0, stop=("\n",), stop_tokens=frozenset({2}),
                               cache_scope="key", priority=-1, timeout_s=2.5, seed=7)
    submit = ("submit", 3, [1, 5, 9], settings, ("json_object", '{"grammars": []}'), ())
    assert decode(encode(submit)) == submit
    event = TokenEvent(token=5, text="a", logprob=-0.5, top_logprobs=[(5, -0.5)], final_offsets=(0,))
    result = RequestResult(tokens=[5], text="a", logprobs=None, prompt_logprobs=None, finish_reason="stop",
                           stop_token=2, n_prompt_tokens=3, n_cached_prompt_tokens=0, queue_time_s=0.01)
    stats = {"queued": 0, "slots_in_use": 1, "kv_blocks_total": 10}
    kind, events, got_stats = decode(encode(("events", [(3, event), (3, result)], stats)))
    assert (kind, events, got_stats) == ("events", [(3, event), (3, result)], stats)
    # errors travel as themselves, or as a RuntimeError naming them where they do not pickle
    _, [(_, stopped), (_, other)], _ = decode(encode(("events", [(1, EngineStopped("bye")),
                                                                 (2, _Unpicklable("odd"))], {})))
    assert isinstance(stopped, EngineStopped) and str(stopped) == "bye"
    assert type(other) is RuntimeError and str(other) == "_Unpicklable: odd"
    # a prompt's images travel with their pixels (and so the same digest, which the prefix cache keys on)
    import torch

    from llama.images.prompt import PromptImage

    image = PromptImage(pixel_values=torch.rand(1, 3, 4, 4), grid=(1, 1), start=1, end=4, patch_positions=(2,))
    _, _, _, _, _, (got,) = decode(encode(("submit", 4, [1, 2, 3, 4, 5], settings, None, (image,))))
    assert torch.equal(got.pixel_values, image.pixel_values) and got.digest == image.digest
    assert (got.grid, got.start, got.end, got.patch_positions) == ((1, 1), 1, 4, (2,))
    for message in [("cancel", 3), ("arriving", 1), ("arriving", -1), ("stop",), ("stopped",)]:
        assert decode(encode(message)) == message
    with pytest.raises(ValueError, match="not a message"):
        decode(encode([1, 2]))  # type: ignore[arg-type]


def test_settings_travel_without_their_grammar():
    grammar = SimpleNamespace(kind="regex", source='{"grammars": [1]}')
    settings = RequestSettings(max_new_tokens=3, grammar=None)
    assert grammar_source(settings) == (settings, None)
    sent, source = grammar_source(dataclasses.replace(settings, grammar=grammar))  # type: ignore[arg-type]
    assert sent == settings and source == ("regex", '{"grammars": [1]}')
    with pytest.raises(ValueError, match="logits_processor"):
        grammar_source(dataclasses.replace(settings, logits_processor=lambda t, x: x))


class Pair:
    """A fake engine behind an EngineBridge, an EngineClient on the other end of a socket pair,
    the client's reading loop on a thread."""

    def __init__(self, tokenizer) -> None:
        self.engine = FakeEngine(tokenizer, max_batch_size=2, max_seq_len=64, max_queue=8, step_s=0.002)
        a, b = socket.socketpair()
        self.engine_end, self.api_end = Connection(a.detach()), Connection(b.detach())
        self.engine_stop = threading.Event()
        self.bridge = EngineBridge(SimpleNamespace(engine=self.engine, tokenizer=tokenizer), self.engine_end,
                                   self.engine_stop)
        self.bridge.start()
        # the first rank's main thread: the engine's loop, then the bridge's last message
        self.engine_main = threading.Thread(target=self._run_engine, daemon=True)
        self.engine_main.start()
        info = {"max_batch_size": 2, "max_seq_len": 64, "n_decodable": tokenizer.n_words, "lora": {}}
        self.client = EngineClient(self.api_end, info)
        self.stop = threading.Event()
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run_engine(self) -> None:
        self.engine.run_forever(self.engine_stop)
        self.bridge.close()

    def _run(self) -> None:
        try:
            self.client.run_forever(self.stop)
        except BaseException as e:
            self.error.append(e)

    def submit(self, prompt, settings):
        got: list = []
        done = threading.Event()

        def on_event(item):
            got.append(item)
            if not isinstance(item, TokenEvent):
                done.set()

        return self.client.submit(prompt, settings, on_event), got, done

    def die(self) -> None:
        """The engine's end goes, as when its process dies (the kernel shuts its socket)."""
        socket.socket(fileno=os.dup(self.engine_end.fileno())).shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT_S)
        self.engine_stop.set()
        self.engine_main.join(TIMEOUT_S)
        assert not self.thread.is_alive() and not self.engine_main.is_alive()


def test_a_client_gets_the_engines_events_and_can_cancel(tokenizer):
    pair = Pair(tokenizer)
    try:
        prompt = tokenizer.encode("Hello", bos=True, eos=False)
        greedy = RequestSettings(max_new_tokens=6, temperature=0.0)
        handle, got, done = pair.submit(prompt, greedy)
        assert done.wait(TIMEOUT_S) and handle.finished
        *events, result = got
        assert isinstance(result, RequestResult) and result.finish_reason == "length"
        # what the engine generated, token by token: the fake engine's script
        assert [e.token for e in events if e.token is not None] == result.tokens == pair.engine.script[:6]
        assert "".join(e.text for e in events) == result.text
        assert pair.client.stats()["queued"] == pair.client.stats()["slots_in_use"] == 0

        pair.engine.paused.set()  # requests pile up: the client counts them as the engine would
        held = [pair.submit(prompt, greedy) for _ in range(3)]
        assert pair.client.stats()["queued"] + pair.client.stats()["slots_in_use"] == 3
        held[0][0].cancel()
        pair.engine.paused.clear()
        for _, _, finished in held:
            assert finished.wait(TIMEOUT_S)
        assert held[0][1][-1].finish_reason == "cancelled"
        assert [r[1][-1].finish_reason for r in held[1:]] == ["length", "length"]
        # refused by the client as the engine would refuse it, at once
        with pytest.raises(ValueError, match="max_seq_len"):
            pair.client.submit(list(range(1, 70)), greedy)
        with pytest.raises(ValueError, match="temperature"):
            pair.client.submit(prompt, dataclasses.replace(greedy, temperature=math.nan))
    finally:
        pair.close()
    assert not pair.error


def test_the_engine_gone_fails_every_request_in_flight_at_once(tokenizer):
    pair = Pair(tokenizer)
    try:
        pair.engine.paused.set()
        requests = [pair.submit([1, 2, 3], RequestSettings(max_new_tokens=4)) for _ in range(3)]
        pair.die()
        pair.thread.join(TIMEOUT_S)
        assert not pair.thread.is_alive()
        assert len(pair.error) == 1 and isinstance(pair.error[0], EngineDied)
        for handle, got, done in requests:
            assert done.is_set() and handle.finished and isinstance(got[-1], EngineDied)
        with pytest.raises(EngineStopped, match="engine"):  # (the server answers 503)
            pair.client.submit([1, 2, 3], RequestSettings(max_new_tokens=4))
    finally:
        pair.engine.paused.clear()
        pair.close()
