"""The server's Prometheus metrics.
"""

from __future__ import annotations

from llama.serve.protocols import ServedEngine


class ServerMetrics:
    """The Prometheus metrics of one server (its own registry, so tests can build several)."""

    def __init__(self, engine: ServedEngine) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "llama_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("llama_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("llama_generation_tokens", "Tokens generated for clients", registry=r)
        self.cached_prompt_tokens = Counter(
            "llama_cached_prompt_tokens", "Prompt tokens reused from the prefix cache (not prefilled)", registry=r
        )
        latency_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.time_to_first_token = Histogram(
            "llama_time_to_first_token_seconds", "From submission to the first token", buckets=latency_buckets,
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

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
