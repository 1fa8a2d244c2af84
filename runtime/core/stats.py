# SPDX-License-Identifier: Apache-2.0
"""What the engine tells the outside world about itself, as immutable snapshots.

`EngineInfo` is fixed when the engine is built; `EngineStats` is taken by the engine loop
thread after every step and published whole, so the HTTP event loop (`/get_server_info`,
`/flush_cache`, `/metrics`) reads a consistent picture without touching the scheduler.
Field names follow SGLang's `/get_server_info` (`internal_states`) and its Prometheus gauges.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineInfo:
    model_path: str
    context_length: int
    max_total_tokens: int  # KV cache token slots actually allocated
    page_size: int
    max_running_requests: int
    kv_cache_bytes: int
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_disable_by_batch_size: int | str | None = None  # a batch size, "auto", None
    speculative_token_map: str | None = None  # the draft's hot-vocabulary file, if any
    # what each rank of the replica holds after start-up: rank, pid, weights, kv_cache,
    # peak_rss (bytes), device_allocated
    rank_memory: tuple[dict, ...] = ()

    def to_json(self) -> dict:
        out = asdict(self)
        out["rank_memory"] = list(out["rank_memory"])
        return out


@dataclass(frozen=True)
class EngineStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_retractions: int = 0
    num_finished_reqs: int = 0  # requests finished since start (any reason): a replica's share
    available_tokens: int = 0
    available_request_slots: int = 0
    token_usage: float = 0.0  # fraction of KV token slots in use (as SGLang: evictable is free)
    # prefix (radix) cache: prompt tokens served from it over all requests admitted so far,
    # what it holds now and what it gave back under memory pressure
    cache_hit_rate: float = 0.0  # cache_hit_tokens / cache_prompt_tokens
    cache_hit_tokens: int = 0
    cache_prompt_tokens: int = 0
    cache_evicted_tokens: int = 0
    cache_evicted_snapshots: int = 0
    cache_tokens: int = 0  # token slots the prefix cache holds
    cache_snapshots: int = 0  # per-request state snapshots it holds
    # speculative decoding, engine-wide (None when it is off); raw counters so a client can
    # take the accept length over its own window. The accept length is over verify rounds
    # alone (spec_emitted_tokens / spec_verify_rounds: accepted drafts + 1 per round), None
    # before the first round; prefill tokens and plain decode steps count in neither.
    avg_spec_accept_length: float | None = None
    spec_acceptance_rate_per_position: tuple[float, ...] | None = None
    spec_verify_rounds: int | None = None
    spec_emitted_tokens: int | None = None
    spec_plain_decode_tokens: int | None = None  # decoded in steps that did not speculate
    # with `--speculative-disable-by-batch-size auto`, per batch bucket: whether it speculates
    # now, its measured round and plain step (ms) and how many of each it timed
    spec_buckets: dict | None = None

    @property
    def is_idle(self) -> bool:
        return self.num_running_reqs == 0 and self.num_waiting_reqs == 0

    def to_json(self) -> dict:
        out = asdict(self)
        rates = out["spec_acceptance_rate_per_position"]
        out["spec_acceptance_rate_per_position"] = None if rates is None else list(rates)
        return out
