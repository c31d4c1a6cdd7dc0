"""Prometheus metrics for `jlora serve`, in a per-app registry (several apps in one process don't clash).

Per-request numbers (tokens, latencies, outcomes) are pushed by the engine thread as requests end.
Engine state (queues, KV blocks, adapter slots, compiles) is read from a snapshot the engine thread
refreshes after every step, so a scrape never touches the (not thread-safe) engine.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# snapshot key -> (metric name, kind, help)
_ENGINE_METRICS = {
    "running": ("jlora_num_requests_running", "gauge", "Sequences in the running batch (a request with n samples counts n)."),
    "waiting": ("jlora_num_requests_waiting", "gauge", "Sequences waiting for admission (KV blocks, a sequence place or an adapter slot)."),
    "kv_blocks_used": ("jlora_kv_blocks_used", "gauge", "KV cache blocks in use."),
    "kv_blocks_total": ("jlora_kv_blocks_total", "gauge", "KV cache blocks in all."),
    "lora_resident": ("jlora_lora_slots_resident", "gauge", "Device adapter slots holding a current adapter."),
    "lora_slot_hits": ("jlora_lora_slot_hits", "counter", "Adapter acquisitions served by a resident slot."),
    "lora_disk_loads": ("jlora_lora_disk_loads", "counter", "Adapters read and converted from disk."),
    "lora_host_hits": ("jlora_lora_host_hits", "counter", "Adapter loads served by the host cache."),
    "lora_slot_writes": ("jlora_lora_slot_writes", "counter", "Adapter writes into a device slot."),
    "lora_evictions": ("jlora_lora_evictions", "counter", "Resident adapters evicted from a device slot."),
    "preemptions": ("jlora_num_preemptions", "counter", "Sequences preempted (recomputed later) for lack of KV blocks."),
    "prefix_cache_queries": ("jlora_prefix_cache_queries", "counter",
                             "Prompt tokens looked up in the prefix cache at admission (vLLM's prefix_cache_queries)."),
    "prefix_cache_hits": ("jlora_prefix_cache_hits", "counter",
                          "Of them, tokens whose KV blocks were cached under the same adapter version "
                          "(vLLM's prefix_cache_hits)."),
    "kv_blocks_cached": ("jlora_kv_blocks_cached", "gauge", "Free KV blocks still holding a cached prefix (evicted LRU)."),
    "compiles_after_warmup": ("jlora_xla_compiles_after_warmup", "counter", "XLA compilations since the server finished warm-up (should stay 0)."),
}


class _EngineCollector:
    def __init__(self) -> None:
        self.snapshot: dict[str, float] = {k: 0.0 for k in _ENGINE_METRICS}

    def collect(self) -> Iterator[Metric]:
        snap = dict(self.snapshot)  # replaced wholesale by the engine thread; copy for a consistent read
        for key, (name, kind, doc) in _ENGINE_METRICS.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=float(snap.get(key, 0.0)))


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("jlora_requests", "Generation requests by outcome: stop, length, abort "
                                "(client gone or shutdown) or rejected (4xx).", ["status"], registry=r)
        self.prompt_tokens = Counter("jlora_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("jlora_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram("jlora_time_to_first_token_seconds", "From receipt to the first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("jlora_time_per_output_token_seconds", "Per output token after the first.",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("jlora_e2e_request_latency_seconds", "From receipt to the last token.",
                             buckets=_E2E_BUCKETS, registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)

    def set_engine_snapshot(self, snapshot: dict[str, float]) -> None:
        self._engine.snapshot = snapshot

    def request_done(self, status: str, prompt_tokens: int, generated_tokens: int, received: float,
                     first_token: float | None, finished: float) -> None:
        self.requests.labels(status=status).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        if first_token is not None:
            self.ttft.observe(max(first_token - received, 0.0))
            if generated_tokens > 1:
                self.tpot.observe(max(finished - first_token, 0.0) / (generated_tokens - 1))
        self.e2e.observe(max(finished - received, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
