"""Server counters and their Prometheus text exposition (/metrics, through prometheus_client):
requests, tokens, prefill and decode rates, queue, KV fill, guard tier, draft acceptance, health;
as `vkflash_*` and, for tools written against llama-server, under its `llamacpp:*` names."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vkflash.engine.api import Finish


@dataclass(frozen=True)
class Live:
    """Values /metrics reads at the moment it answers: the slot and the KV cache."""

    processing: int = 0
    deferred: int = 0
    kv_tokens: int = 0
    n_ctx: int = 0


@dataclass
class Metrics:
    """Totals since start; updated from the event loop (requests) and the worker (finishes)."""

    requests: Counter[tuple[str, int]] = field(default_factory=Counter)
    finishes: Counter[str] = field(default_factory=Counter)
    rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    last_prompt_rate: float = 0.0
    last_decode_rate: float = 0.0
    draft_tokens: int = 0
    draft_accepted: int = 0
    n_decode: int = 0
    n_tokens_max: int = 0
    ubatch: int = 2048
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def request(self, path: str, status: int) -> None:
        """Count one answered HTTP request."""
        with self._lock:
            self.requests[(path, status)] += 1

    def reject(self) -> None:
        """Count one request refused for a full queue."""
        with self._lock:
            self.rejected += 1

    def finish(self, fin: Finish) -> None:
        """Fold one generation's counts and timings in."""
        t = fin.timings
        with self._lock:
            self.finishes[fin.reason] += 1
            self.prompt_tokens += t.prompt_n
            self.cached_tokens += t.cache_n
            self.generated_tokens += t.predicted_n
            self.prompt_seconds += t.prompt_ms / 1e3
            self.decode_seconds += t.predicted_ms / 1e3
            j = t.to_json()
            if t.prompt_n:
                self.last_prompt_rate = float(j["prompt_per_second"])
            if t.predicted_n > 1:
                self.last_decode_rate = float(j["predicted_per_second"])
            self.draft_tokens += t.draft_n or 0
            self.draft_accepted += t.draft_n_accepted or 0
            # forward calls: one per prefill ubatch, then one per decode step (a speculation round
            # yields its accepted drafts and one token of its own)
            self.n_decode += -(-t.prompt_n // self.ubatch) + max(0, t.predicted_n - 1 - (t.draft_n_accepted or 0))
            self.n_tokens_max = max(self.n_tokens_max, t.prompt_n + t.predicted_n)

    def render(self, gauges: dict[str, tuple[str, float]], live: Live) -> str:
        """Prometheus text format; `gauges` maps name → (help, value) of further vkflash_* gauges."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self, gauges, live))
        return generate_latest(registry).decode()

    def families(self, gauges: dict[str, tuple[str, float]], live: Live) -> Iterator[Metric]:
        """Every metric family: vkflash_* first, then llama-server's llamacpp:* names."""
        def counter(name: str, help_: str, value: float, labels: dict[str, str] | None = None) -> Metric:
            c = CounterMetricFamily(name, help_, labels=sorted(labels or {}))
            c.add_metric([v for _, v in sorted((labels or {}).items())], value)
            return c

        def gauge(name: str, help_: str, value: float) -> Metric:
            return GaugeMetricFamily(name, help_, value=value)

        with self._lock:
            req = CounterMetricFamily("vkflash_requests", "HTTP requests answered, by path and status",
                                      labels=["path", "status"])
            for (p, st), n in sorted(self.requests.items()):
                req.add_metric([p, str(st)], n)
            gen = CounterMetricFamily("vkflash_generations", "generations ended, by finish reason", labels=["reason"])
            for r, n in sorted(self.finishes.items()):
                gen.add_metric([r], n)
            out = [
                req, gen,
                counter("vkflash_rejected", "requests refused because the queue was full", self.rejected),
                counter("vkflash_prompt_tokens", "prompt tokens prefilled", self.prompt_tokens),
                counter("vkflash_prompt_tokens_cached", "prompt tokens reused from the last sequence (not prefilled)",
                        self.cached_tokens),
                counter("vkflash_generated_tokens", "tokens generated", self.generated_tokens),
                counter("vkflash_prompt_seconds", "time spent in prefill", self.prompt_seconds),
                counter("vkflash_decode_seconds", "time spent decoding", self.decode_seconds),
                gauge("vkflash_prompt_tokens_per_second", "prefill rate of the last request", self.last_prompt_rate),
                gauge("vkflash_decode_tokens_per_second", "decode rate of the last request", self.last_decode_rate),
                counter("vkflash_draft_tokens", "MTP draft tokens proposed", self.draft_tokens),
                counter("vkflash_draft_accepted", "MTP draft tokens accepted", self.draft_accepted),
                gauge("vkflash_draft_acceptance_ratio", "MTP draft tokens accepted / proposed, since start",
                      self.draft_accepted / self.draft_tokens if self.draft_tokens else 0.0),
                *(gauge(f"vkflash_{name}", help_, value) for name, (help_, value) in gauges.items()),
                counter("llamacpp:prompt_tokens", "Number of prompt tokens processed, excluding cached tokens",
                        self.prompt_tokens),
                counter("llamacpp:prompt_seconds", "Total time spent processing prompts", self.prompt_seconds),
                counter("llamacpp:tokens_predicted", "Number of generation tokens processed", self.generated_tokens),
                counter("llamacpp:tokens_predicted_seconds", "Total time spent generating tokens",
                        self.decode_seconds),
                counter("llamacpp:n_decode", "Total number of forward calls (prefill ubatches and decode steps), "
                        "excluding drafting", self.n_decode),
                gauge("llamacpp:n_tokens_max", "Largest observed sequence length (prompt + generation)",
                      self.n_tokens_max),
                counter("llamacpp:spec_decode_num_draft_tokens", "Speculative: Total draft tokens generated",
                        self.draft_tokens),
                counter("llamacpp:spec_decode_num_accepted_tokens",
                        "Speculative: Total draft tokens accepted by the target model", self.draft_accepted),
                gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s",
                      self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0),
                gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s",
                      self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0),
            ]
        out += [
            gauge("llamacpp:requests_processing", "Number of requests processing", live.processing),
            gauge("llamacpp:requests_deferred", "Number of requests deferred", live.deferred),
            gauge("llamacpp:n_busy_slots_per_decode", "Average number of busy slots per forward call (one slot)",
                  1.0 if self.n_decode else 0.0),
            gauge("llamacpp:kv_cache_tokens", "KV-cache tokens.", live.kv_tokens),
            gauge("llamacpp:kv_cache_usage_ratio", "KV-cache usage. 1 = 100 percent usage.",
                  live.kv_tokens / live.n_ctx if live.n_ctx else 0.0),
        ]
        return iter(out)


@dataclass(eq=False)
class _Collector:
    """A prometheus_client collector over one snapshot of the server's metrics."""

    metrics: Metrics
    gauges: dict[str, tuple[str, float]]
    live: Live

    def collect(self) -> Iterator[Metric]:
        return self.metrics.families(self.gauges, self.live)
