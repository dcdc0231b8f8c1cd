"""The server's Prometheus metrics: ours (``llama_*``) and the same quantities under vLLM's names
(``vllm:*``, label ``model_name``), so that vLLM's Grafana dashboards work unchanged.

vLLM's names and what they hold here (each from the same observations as ours where we have one):

* gauges: ``vllm:num_requests_running`` (= ``llama_slots_in_use``), ``vllm:num_requests_waiting``
  (= ``llama_queue_depth``: waiting to start or to resume), ``vllm:kv_cache_usage_perc`` (a
  fraction, as vLLM's: ``llama_kv_blocks_in_use / llama_kv_blocks_total``);
* counters: ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total`` (= ``llama_prompt_tokens``,
  ``llama_generation_tokens``), ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``
  (prompt tokens looked up in the prefix cache and found there, as vLLM counts them, by finished
  request: = ``llama_prompt_tokens``, ``llama_cached_prompt_tokens``), ``vllm:num_preemptions_total``
  (= ``llama_preemptions_total``), ``vllm:request_success_total`` by ``finished_reason`` ("stop",
  "length", "abort" for a request cancelled by its client, and "timeout": past its deadline);
* histograms: ``vllm:time_to_first_token_seconds`` (= ``llama_time_to_first_token_seconds``, its
  buckets too), ``vllm:e2e_request_latency_seconds`` (submission to result),
  ``vllm:inter_token_latency_seconds`` (each gap between a request's tokens as the server receives
  them: tokens a step gives at once come 0 s apart), ``vllm:time_per_output_token_seconds`` (per
  request, its decoding time over its tokens after the first: 1 / ``llama_request_tokens_per_second``),
  ``vllm:request_queue_time_seconds`` (submission to the engine's start of it),
  ``vllm:request_prefill_time_seconds`` (start to first token), ``vllm:request_decode_time_seconds``
  (first to last token), ``vllm:request_inference_time_seconds`` (start to last token),
  ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens`` (per engine request: one per
  choice) and ``vllm:request_max_num_generation_tokens`` (per HTTP request, the most tokens one of its
  choices generated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional

from llama.serve.protocols import ServedEngine

if TYPE_CHECKING:
    from prometheus_client import Counter, Histogram
    from prometheus_client.metrics_core import Metric

    from llama.engine import RequestResult

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# vLLM's for the time between tokens and per-request phases
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
# the engine's finish reasons as vLLM's finished_reason label gives them
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "timeout": "timeout"}


class ServerMetrics:
    """The Prometheus metrics of one server (its own registry, so tests can build several).
    ``model_name``: the ``model_name`` label of the ``vllm:*`` metrics."""

    def __init__(self, engine: ServedEngine, model_name: str = "") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = model_name
        self.requests = Counter(
            "llama_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("llama_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("llama_generation_tokens", "Tokens generated for clients", registry=r)
        self.cached_prompt_tokens = Counter(
            "llama_cached_prompt_tokens", "Prompt tokens reused from the prefix cache (not prefilled)", registry=r
        )
        self.time_to_first_token = Histogram(
            "llama_time_to_first_token_seconds", "From submission to the first token", buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens_per_second = Histogram(
            "llama_request_tokens_per_second", "Decoding speed of each request after its first token",
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r,
        )
        stats = engine.stats
        Gauge("llama_queue_depth", "Requests waiting to run (or to resume)",
              registry=r).set_function(lambda: stats()["queued"])
        Gauge("llama_slots_in_use", "KV-cache slots held by requests", registry=r).set_function(
            lambda: stats()["slots_in_use"]
        )
        Gauge("llama_slots_total", "Requests decoded together at most (max_batch_size)", registry=r).set(
            engine.max_batch_size)
        for name, key, doc in (
            ("llama_kv_blocks_total", "kv_blocks_total", "Blocks of the paged KV cache"),
            ("llama_kv_blocks_in_use", "kv_blocks_in_use", "KV-cache blocks held by requests"),
            ("llama_kv_blocks_cached", "kv_blocks_cached", "KV-cache blocks in the prefix cache (held or not)"),
            ("llama_prefix_cache_hits_total", "prefix_cache_hits_total",
             "Requests whose prompt began with blocks found in the prefix cache"),
            ("llama_preemptions_total", "preemptions_total",
             "Running requests whose blocks were taken back for others (resumed later)"),
            ("llama_speculative_proposed_tokens_total", "spec_proposed_tokens_total",
             "Tokens proposed by speculative decoding and checked by the model (--speculative)"),
            ("llama_speculative_accepted_tokens_total", "spec_accepted_tokens_total",
             "Proposed tokens the model agreed with (each one a token generated without a step of its own)"),
        ):
            Gauge(name, doc, registry=r).set_function(lambda key=key: stats().get(key, 0))  # type: ignore[misc]  # the default binds key
        self._vllm(engine)

    def _vllm(self, engine: ServedEngine) -> None:
        """vLLM's metrics (the module's docstring), labelled ``model_name``."""
        from prometheus_client import Counter, Histogram

        r, label = self.registry, ["model_name"]
        name = self.model_name
        r.register(_EngineGauges(engine, name))

        def histogram(metric: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(metric, doc, label, buckets=buckets, registry=r).labels(name)

        def counter(metric: str, doc: str) -> Counter:
            return Counter(metric, doc, label, registry=r).labels(name)

        self.v_prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
        self.v_generation_tokens = counter("vllm:generation_tokens", "Tokens generated for clients")
        self.v_prefix_queries = counter("vllm:prefix_cache_queries",
                                        "Prompt tokens looked up in the prefix cache (finished requests)")
        self.v_prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.v_success = Counter("vllm:request_success", "Finished requests by finished_reason",
                                 ["model_name", "finished_reason"], registry=r)
        for reason in FINISHED_REASONS.values():  # each series exists from the start, at 0
            self.v_success.labels(name, reason)
        self.v_ttft = histogram("vllm:time_to_first_token_seconds", "From submission to the first token",
                                LATENCY_BUCKETS)
        self.v_e2e = histogram("vllm:e2e_request_latency_seconds", "From submission to the result",
                               REQUEST_TIME_BUCKETS)
        self.v_itl = histogram("vllm:inter_token_latency_seconds", "Between a request's successive tokens",
                               TOKEN_GAP_BUCKETS)
        self.v_tpot = histogram("vllm:time_per_output_token_seconds",
                                "A request's decoding time over its tokens after the first", TOKEN_GAP_BUCKETS)
        self.v_queue = histogram("vllm:request_queue_time_seconds", "From submission to the engine's start of it",
                                 REQUEST_TIME_BUCKETS)
        self.v_prefill = histogram("vllm:request_prefill_time_seconds", "From its start to its first token",
                                   REQUEST_TIME_BUCKETS)
        self.v_decode = histogram("vllm:request_decode_time_seconds", "From its first token to its last",
                                  REQUEST_TIME_BUCKETS)
        self.v_inference = histogram("vllm:request_inference_time_seconds", "From its start to its last token",
                                     REQUEST_TIME_BUCKETS)
        self.v_request_prompt = histogram("vllm:request_prompt_tokens", "Prompt tokens of each finished request",
                                          TOKEN_COUNT_BUCKETS)
        self.v_request_generation = histogram("vllm:request_generation_tokens",
                                              "Tokens generated by each finished request", TOKEN_COUNT_BUCKETS)
        self.v_max_generation = histogram("vllm:request_max_num_generation_tokens",
                                          "The most tokens one choice of an HTTP request generated",
                                          TOKEN_COUNT_BUCKETS)

    # -- what the endpoints observe (llama.serve.requests) --

    def first_token(self, seconds: float) -> None:
        """A request's first token came ``seconds`` after its submission."""
        self.time_to_first_token.observe(seconds)
        self.v_ttft.observe(seconds)

    def next_token(self, gap: float) -> None:
        """A request's token came ``gap`` seconds after its previous one."""
        self.v_itl.observe(gap)

    def request_finished(self, result: RequestResult, *, e2e_s: float, first_s: Optional[float],
                         last_s: Optional[float], n_tokens: int) -> None:
        """One engine request ended with ``result``, ``e2e_s`` after its submission; its first and
        last token events came ``first_s`` and ``last_s`` after it (None: it had none), and it had
        ``n_tokens`` of them."""
        self.prompt_tokens.inc(result.n_prompt_tokens)
        self.cached_prompt_tokens.inc(result.n_cached_prompt_tokens)
        self.generation_tokens.inc(len(result.tokens))
        v = self  # vLLM's names
        v.v_prompt_tokens.inc(result.n_prompt_tokens)
        v.v_generation_tokens.inc(len(result.tokens))
        v.v_prefix_queries.inc(result.n_prompt_tokens)
        v.v_prefix_hits.inc(result.n_cached_prompt_tokens)
        v.v_success.labels(self.model_name, FINISHED_REASONS.get(result.finish_reason, result.finish_reason)).inc()
        v.v_e2e.observe(e2e_s)
        v.v_request_prompt.observe(result.n_prompt_tokens)
        v.v_request_generation.observe(len(result.tokens))
        queued = result.queue_time_s
        if queued is not None:
            v.v_queue.observe(queued)
        if first_s is None or last_s is None:
            return
        if queued is not None:
            v.v_prefill.observe(max(0.0, first_s - queued))
            v.v_inference.observe(max(0.0, last_s - queued))
        v.v_decode.observe(last_s - first_s)
        if n_tokens > 1 and last_s > first_s:
            self.tokens_per_second.observe((n_tokens - 1) / (last_s - first_s))
            v.v_tpot.observe((last_s - first_s) / (n_tokens - 1))

    def group_finished(self, most_generated: int) -> None:
        """Every choice of an HTTP request ended; the most tokens one of them generated."""
        self.v_max_generation.observe(most_generated)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineGauges:
    """vLLM's metrics read from the engine's ``stats()`` when ``/metrics`` is read: one reading
    for all of them."""

    def __init__(self, engine: ServedEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.engine.stats()
        labels, values = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        yield gauge("vllm:num_requests_running", "Requests running (decoded together)", stats.get("slots_in_use", 0))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to start or to resume", stats.get("queued", 0))
        total = stats.get("kv_blocks_total", 0)
        yield gauge("vllm:kv_cache_usage_perc", "Share of the KV cache's blocks held by requests (1 = full)",
                    stats.get("kv_blocks_in_use", 0) / total if total else 0.0)
        c = CounterMetricFamily("vllm:num_preemptions", "Running requests whose blocks were taken back for others",
                                labels=labels)
        c.add_metric(values, stats.get("preemptions_total", 0))
        yield c
        if "replicas" in stats:  # --data_parallel: each replica's, labelled by its index (the totals above)
            yield from _replica_gauges(stats["replicas"], self.model_name)


def _replica_gauges(replicas: list[dict], model_name: str) -> Iterator[Metric]:
    from prometheus_client.core import GaugeMetricFamily

    labels = ["model_name", "replica"]
    up = GaugeMetricFamily("llama_replica_up", "1 while the engine replica serves, 0 once it died", labels=labels)
    running = GaugeMetricFamily("llama_replica_requests_running", "Requests running on the replica", labels=labels)
    waiting = GaugeMetricFamily("llama_replica_requests_waiting", "Requests waiting on the replica", labels=labels)
    usage = GaugeMetricFamily("llama_replica_kv_cache_usage_perc", "Share of the replica's KV-cache blocks held",
                              labels=labels)
    for k, stats in enumerate(replicas):
        values = [model_name, str(k)]
        up.add_metric(values, 1 if stats else 0)
        running.add_metric(values, stats.get("slots_in_use", 0))
        waiting.add_metric(values, stats.get("queued", 0))
        total = stats.get("kv_blocks_total", 0)
        usage.add_metric(values, stats.get("kv_blocks_in_use", 0) / total if total else 0.0)
    yield from (up, running, waiting, usage)
