"""Server counters and their Prometheus text exposition (/metrics): requests, tokens, prefill
and decode rates, queue, KV fill, guard tier, draft acceptance, health."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from vkflash.engine.api import Finish


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

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """Prometheus text format; `gauges` maps name → (help, value) for live values."""
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP vkflash_{name} {help_}")
            out.append(f"# TYPE vkflash_{name} {kind}")
            out.extend(f"vkflash_{name}{labels} {_num(v)}" for labels, v in samples)

        with self._lock:
            family("requests_total", "counter", "HTTP requests answered, by path and status",
                   [(f'{{path="{p}",status="{s}"}}', n) for (p, s), n in sorted(self.requests.items())])
            family("generations_total", "counter", "generations ended, by finish reason",
                   [(f'{{reason="{r}"}}', n) for r, n in sorted(self.finishes.items())])
            family("rejected_total", "counter", "requests refused because the queue was full", [("", self.rejected)])
            family("prompt_tokens_total", "counter", "prompt tokens prefilled", [("", self.prompt_tokens)])
            family("prompt_tokens_cached_total", "counter", "prompt tokens reused from the last sequence (not prefilled)",
                   [("", self.cached_tokens)])
            family("generated_tokens_total", "counter", "tokens generated", [("", self.generated_tokens)])
            family("prompt_seconds_total", "counter", "time spent in prefill", [("", self.prompt_seconds)])
            family("decode_seconds_total", "counter", "time spent decoding", [("", self.decode_seconds)])
            family("prompt_tokens_per_second", "gauge", "prefill rate of the last request", [("", self.last_prompt_rate)])
            family("decode_tokens_per_second", "gauge", "decode rate of the last request", [("", self.last_decode_rate)])
            family("draft_tokens_total", "counter", "MTP draft tokens proposed", [("", self.draft_tokens)])
            family("draft_accepted_total", "counter", "MTP draft tokens accepted", [("", self.draft_accepted)])
            family("draft_acceptance_ratio", "gauge", "MTP draft tokens accepted / proposed, since start",
                   [("", self.draft_accepted / self.draft_tokens if self.draft_tokens else 0.0)])
        for name, (help_, value) in gauges.items():
            family(name, "gauge", help_, [("", value)])
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    """Prometheus sample value."""
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"

