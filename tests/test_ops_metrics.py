"""``/metrics`` under vLLM's names as well as ours: every series vLLM's published Grafana dashboard
queries is there, labelled ``model_name``, read back with prometheus_client's own parser, and each
holds the value of ours for the same quantity (or of the responses' usage where we have none)."""

from __future__ import annotations

import json
import threading
import time

import pytest

import helpers
from fake_engine import FakeEngine, served_model
from helpers import REPO
from llama.tokenizer import load_tokenizer

MODEL = "demo-test"

# Every series queried by vLLM's dashboard, examples/observability/prometheus_grafana/grafana.json in
# github.com/vllm-project/vllm (commit 4b5c627c23e6690b8987100d1cbf78e34ac14bf9), panel by panel: E2E
# Request Latency, Token Throughput, Inter Token Latency, Scheduler State, Time To First Token
# Latency, Cache Utilization, Request Prompt Length, Request Generation Length, Finish Reason, Queue
# Time, Requests Prefill and Decode Time, Max Generation Token in Sequence Group.  Each expression
# selects {model_name="$model_name"}.
DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
# And those the issue names beside them.
ISSUE_SERIES = ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                "vllm:time_per_output_token_seconds_count"]


def scrape(client) -> dict:
    """``{(sample name, frozenset of labels): value}`` of the /metrics page, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def vllm(samples: dict, name: str, **labels) -> float:
    return value(samples, name, model_name=MODEL, **labels)


def histogram_matches(samples: dict, ours: str, theirs: str) -> None:
    """vLLM's histogram holds the same observations as ours: count, sum and every bucket."""
    for suffix in ("_count", "_sum"):
        assert vllm(samples, theirs + suffix) == value(samples, ours + suffix), suffix
    buckets = {dict(labels)["le"]: v for (name, labels), v in samples.items() if name == ours + "_bucket"}
    assert buckets
    for le, v in buckets.items():
        assert vllm(samples, theirs + "_bucket", le=le) == v, le


@pytest.fixture(scope="module")
def fake():
    from fastapi.testclient import TestClient

    from llama.serve import create_app

    engine = FakeEngine(load_tokenizer(REPO / "demo" / "tokenizer.model"), max_batch_size=4, max_seq_len=256)
    with TestClient(create_app(served_model(engine), MODEL)) as c:
        yield c, engine
    engine.close()


def test_every_series_of_vllm_s_dashboard_is_served(fake):
    client, _ = fake
    assert client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 3}).status_code == 200
    samples = scrape(client)
    names = {name for name, labels in samples if ("model_name", MODEL) in labels}
    missing = [n for n in DASHBOARD_SERIES + ISSUE_SERIES if n not in names]
    assert not missing, missing


def test_vllm_s_values_are_ours(fake):
    client, engine = fake
    before = scrape(client)
    usages, max_generated = [], []
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                                                  "max_tokens": 4, "temperature": 0.9, "seed": 1})
    assert r.status_code == 200, r.text
    usages.append(r.json()["usage"])
    max_generated.append(4)  # both cut at 4
    r = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 200, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    usages.append(events[-1]["usage"])
    max_generated.append(usages[-1]["completion_tokens"])  # one choice: the script, to its EOS
    after = scrape(client)

    def delta(name: str, **labels) -> float:
        key = (name, frozenset({"model_name": MODEL, **labels}.items()) if name.startswith("vllm:")
               else frozenset(labels.items()))
        return after[key] - before.get(key, 0.0)

    # by engine request: the chat's two choices each had its prompt (usage counts it once)
    prompt = 2 * usages[0]["prompt_tokens"] + usages[1]["prompt_tokens"]
    generated = sum(u["completion_tokens"] for u in usages)
    assert delta("vllm:prompt_tokens_total") == delta("llama_prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == delta("llama_generation_tokens_total") == generated
    assert delta("vllm:prefix_cache_queries_total") == prompt
    assert delta("vllm:prefix_cache_hits_total") == delta("llama_cached_prompt_tokens_total")
    # three engine requests (n=2, then one): two cut by max_tokens, one at the script's EOS
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:request_success_total", finished_reason="stop") == 1
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:request_prompt_tokens_count",
                 "vllm:request_generation_tokens_count"):
        assert delta(name) == 3, name
    assert delta("vllm:request_generation_tokens_sum") == generated
    assert delta("vllm:request_max_num_generation_tokens_count") == 2
    assert delta("vllm:request_max_num_generation_tokens_sum") == sum(max_generated)
    # a token gap for every token but each request's first
    assert delta("vllm:inter_token_latency_seconds_count") == generated - 3
    assert delta("vllm:time_per_output_token_seconds_count") == delta("llama_request_tokens_per_second_count") == 3
    histogram_matches(after, "llama_time_to_first_token_seconds", "vllm:time_to_first_token_seconds")
    assert vllm(after, "vllm:num_preemptions_total") == value(after, "llama_preemptions_total") == 0


def test_the_gauges_are_ours(fake):
    """A request waiting (the fake engine paused): vLLM's gauges read what ours read."""
    client, engine = fake
    engine.paused.set()
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(r=client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 2})))
    thread.start()
    try:
        while engine.stats()["queued"] == 0:
            time.sleep(0.005)
        samples = scrape(client)
    finally:
        engine.paused.clear()
        thread.join(10)
    assert vllm(samples, "vllm:num_requests_waiting") == value(samples, "llama_queue_depth") == 1
    assert vllm(samples, "vllm:num_requests_running") == value(samples, "llama_slots_in_use") == 0
    assert answer["r"].status_code == 200


def test_the_engine_s_numbers_on_a_real_engine(llama3_checkpoint):
    """Behind a real engine: the prefix cache's hits, the KV cache's use, preemptions, and the
    times of each request's phases (queued, prefilled, decoded) against its end-to-end time."""
    from fastapi.testclient import TestClient

    from llama.serve import create_app

    llama = helpers.build(llama3_checkpoint, max_seq_len=96, max_batch_size=2, dtype="float32", compile=False,
                          kv_block_size=8)
    stop = threading.Event()
    thread = threading.Thread(target=llama.engine.run_forever, args=(stop,), daemon=True)
    thread.start()
    try:
        with TestClient(create_app(llama, MODEL)) as client:
            prompt = [1] + list(range(10, 50))  # 41 tokens: 5 whole blocks of 8
            for _ in range(2):  # the second finds the first's blocks
                r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0})
                assert r.status_code == 200, r.text
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == 40
            samples = scrape(client)
            stats = llama.engine.stats()
    finally:
        stop.set()
        thread.join(30)
    assert vllm(samples, "vllm:prefix_cache_hits_total") == value(samples, "llama_cached_prompt_tokens_total") == 40
    assert vllm(samples, "vllm:prefix_cache_queries_total") == 2 * len(prompt)
    assert vllm(samples, "vllm:kv_cache_usage_perc") == \
        value(samples, "llama_kv_blocks_in_use") / value(samples, "llama_kv_blocks_total") == \
        stats["kv_blocks_in_use"] / stats["kv_blocks_total"]
    assert vllm(samples, "vllm:num_preemptions_total") == value(samples, "llama_preemptions_total")
    assert vllm(samples, "vllm:request_queue_time_seconds_count") == 2
    queue = vllm(samples, "vllm:request_queue_time_seconds_sum")
    prefill = vllm(samples, "vllm:request_prefill_time_seconds_sum")
    decode = vllm(samples, "vllm:request_decode_time_seconds_sum")
    inference = vllm(samples, "vllm:request_inference_time_seconds_sum")
    e2e = vllm(samples, "vllm:e2e_request_latency_seconds_sum")
    assert queue >= 0 and prefill > 0 and decode > 0
    assert inference == pytest.approx(prefill + decode)
    assert queue + inference <= e2e + 1e-3  # the phases fit in the whole (the result comes after the last token)
