# SPDX-License-Identifier: Apache-2.0
"""Prometheus metrics (SGLang's `sglang:` names), fed by the engine loop after every step."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from runtime.core.result import RequestResult
from runtime.core.stats import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def counter(name, doc):
            return Counter(f"sglang:{name}", doc, labels, registry=self.registry).labels(model_name)

        def gauge(name, doc):
            return Gauge(f"sglang:{name}", doc, labels, registry=self.registry).labels(model_name)

        def histogram(name, doc):
            return Histogram(
                f"sglang:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry
            ).labels(model_name)

        self.requests = counter("num_requests", "Finished requests")
        self.aborted = counter("num_aborted_requests", "Requests that ended aborted")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between generated tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency")
        self.running = gauge("num_running_reqs", "Running requests")
        self.waiting = gauge("num_queue_reqs", "Waiting requests")
        self.token_usage = gauge("token_usage", "Fraction of KV cache token slots in use")
        self.accept_length = gauge(
            "spec_accept_length",
            "Tokens per speculative verify round (accepted drafts + 1), over all rounds so far",
        )
        # the raw counts behind it, so a scraper can take the accept length over its own window
        self.spec_verify_rounds = counter("spec_verify_rounds", "Speculative verify rounds")
        self.spec_round_tokens = counter(
            "spec_round_tokens", "Tokens verify rounds yielded (accepted drafts + 1 per round)"
        )
        self.spec_plain_decode_tokens = counter(
            "spec_plain_decode_tokens",
            "Tokens decoded while speculation was paused (plain decode steps)",
        )
        self.throughput = gauge("gen_throughput", "Generated tokens per second in the last step")
        self.cache_hit_rate = gauge(
            "cache_hit_rate", "Fraction of prompt tokens served from the prefix cache"
        )
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache")
        self.evicted_tokens = counter(
            "cache_evicted_tokens", "Token slots the prefix cache gave back under memory pressure"
        )
        self._evicted_seen = 0
        self._spec_seen: dict[str, int] = {}  # EngineStats field -> its value counted so far
        self._seen: dict[str, tuple[int, float]] = {}  # rid -> (tokens counted, time of last token)

    def observe_step(self, results: list[RequestResult], stats: EngineStats, seconds: float):
        """`AsyncEngine`'s `on_step`: runs on the engine loop thread after every step."""
        now = time.perf_counter()
        new_tokens = 0
        for result in results:
            new_tokens += self._observe_tokens(result, now)
            if result.finished:
                self._seen.pop(result.rid, None)
                self.requests.inc()
                self.prompt_tokens.inc(result.prompt_tokens)
                self.cached_tokens.inc(result.cached_tokens)
                self.e2e.observe(result.timing.e2e_latency)
                if result.aborted:
                    self.aborted.inc()
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.token_usage.set(stats.token_usage)
        self.cache_hit_rate.set(stats.cache_hit_rate)
        self.evicted_tokens.inc(max(0, stats.cache_evicted_tokens - self._evicted_seen))
        self._evicted_seen = max(self._evicted_seen, stats.cache_evicted_tokens)
        if stats.avg_spec_accept_length is not None:
            self.accept_length.set(stats.avg_spec_accept_length)
        self._count_up(self.spec_verify_rounds, "spec_verify_rounds", stats)
        self._count_up(self.spec_round_tokens, "spec_emitted_tokens", stats)
        self._count_up(self.spec_plain_decode_tokens, "spec_plain_decode_tokens", stats)
        if seconds > 0:
            self.throughput.set(new_tokens / seconds)

    def _count_up(self, counter, field: str, stats: EngineStats) -> None:
        """Advance `counter` to the engine's running total `stats.<field>` (None: off)."""
        total = getattr(stats, field)
        if total is None:
            return
        seen = self._spec_seen.get(field, 0)
        if total > seen:
            counter.inc(total - seen)
            self._spec_seen[field] = total

    def _observe_tokens(self, result: RequestResult, now: float) -> int:
        """Time to first token or inter-token latency of the tokens new since last time."""
        timing = result.timing
        counted, last = self._seen.get(result.rid, (0, timing.created_at))
        fresh = result.completion_tokens - counted
        if fresh > 0:
            if counted == 0 and timing.first_token_at is not None:
                self.ttft.observe(timing.first_token_at - timing.created_at)
            else:
                for _ in range(fresh):  # a speculative round spreads its gap over its tokens
                    self.itl.observe((now - last) / fresh)
            self.generation_tokens.inc(fresh)
        self._seen[result.rid] = (result.completion_tokens, now)
        return max(fresh, 0)
