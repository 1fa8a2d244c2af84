# SPDX-License-Identifier: Apache-2.0
"""A `Req` as its caller sees it: the typed `RequestResult` snapshot, and the engine-wide
`EngineStats` snapshot. Both are taken on the engine's own thread (see `AsyncEngine`)."""

from __future__ import annotations

import time

from runtime.cache.prefix_cache import PrefixCacheStats
from runtime.cache.slot_table import SlotTable
from runtime.core.request import Req
from runtime.core.result import Logprobs, RequestResult, RequestTiming, SpecCounters
from runtime.core.stats import EngineStats


def request_result(req: Req, num_draft_tokens: int | None, with_text: bool) -> RequestResult:
    """Snapshot of `req`. `num_draft_tokens` is the verify width when speculative decoding
    is on (None when off); `with_text` is False for an engine without a tokenizer."""
    now = time.perf_counter()
    return RequestResult(
        rid=req.rid,
        output_ids=tuple(req.output_ids),
        text=req.visible_text() if with_text else None,
        finish_reason=req.finish_reason,
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        timing=RequestTiming(
            created_at=req.created_at,
            first_token_at=req.first_token_at,
            finished_at=req.finished_at,
            e2e_latency=(req.finished_at or now) - req.created_at,
        ),
        logprobs=_logprobs(req) if req.return_logprob else None,
        spec=None if num_draft_tokens is None else _spec_counters(req, num_draft_tokens),
    )


def _row(row) -> tuple | None:
    return None if row is None else tuple(row)


def _frozen(req: Req, name: str, convert=None) -> tuple:
    """`req.<name>` as a tuple (each row through `convert`), extended from the previous
    snapshot's: the scheduler only appends to these lists (a restarted prefill swaps in new
    ones), so a step costs the rows it added, not every row again (a request scoring a long
    prompt would otherwise copy all its entries on every step, on the engine's thread)."""
    rows = getattr(req, name)
    held = req.snapshot_cache.get(name)
    if held is not None and held[0] is rows and held[1] <= len(rows):
        new = rows[held[1] :]
        frozen = held[2] + tuple(new if convert is None else map(convert, new))
    else:
        frozen = tuple(rows if convert is None else map(convert, rows))
    req.snapshot_cache[name] = (rows, len(rows), frozen)
    return frozen


def _logprobs(req: Req) -> Logprobs:
    ids = req.token_ids_logprob
    return Logprobs(
        input_token_logprobs=_frozen(req, "input_token_logprobs"),
        output_token_logprobs=_frozen(req, "output_token_logprobs"),
        output_top_logprobs=_frozen(req, "output_top_logprobs", _row),
        top_logprobs_num=req.top_logprobs_num,
        input_top_logprobs=_frozen(req, "input_top_logprobs", _row),
        token_ids_logprob=None if ids is None else tuple(ids),
        input_token_ids_logprobs=_frozen(req, "input_token_ids_logprobs", _row),
        output_token_ids_logprobs=_frozen(req, "output_token_ids_logprobs", _row),
        with_text=req.return_text_in_logprobs,
    )


def _spec_counters(req: Req, num_draft_tokens: int) -> SpecCounters:
    """The rounds' own tokens (accepted drafts + 1 each) per round, from the histogram:
    neither the prefill's token nor the tokens of plain decode steps count."""
    rounds = req.spec_verify_ct
    yielded = sum((m + 1) * count for m, count in enumerate(req.spec_accept_hist))
    return SpecCounters(
        verify_rounds=rounds,
        accept_length=yielded / rounds if rounds else None,
        accept_histogram=tuple(req.spec_accept_hist) or (0,) * num_draft_tokens,
        plain_decode_tokens=req.spec_plain_decode_tokens,
    )


def engine_stats(
    scheduler,
    slot_table: SlotTable,
    spec_stats=None,
    num_finished_reqs: int = 0,
    cache: PrefixCacheStats | None = None,
    spec_policy=None,
) -> EngineStats:
    """Load, prefix cache and speculative counters right now; `spec_stats` is the NEXTN
    worker's engine-wide `SpecStats` (None for plain decoding), `spec_policy` its
    `speculation_policy` (what a measured one chose per bucket)."""
    allocator = slot_table.allocator
    available = allocator.available_tokens()
    evictable = cache.evictable_tokens if cache is not None else 0
    spec = {}
    if spec_stats is not None:
        spec = dict(
            avg_spec_accept_length=spec_stats.avg_accept_length,
            spec_acceptance_rate_per_position=tuple(spec_stats.acceptance_rate_per_position()),
            spec_verify_rounds=spec_stats.verify_rounds,
            spec_emitted_tokens=spec_stats.emitted_tokens,
            spec_plain_decode_tokens=spec_stats.plain_decode_tokens,
            spec_buckets=spec_policy.describe() if spec_policy is not None else None,
        )
    cache_fields = {}
    if cache is not None:
        cache_fields = dict(
            cache_hit_rate=cache.hit_rate,
            cache_hit_tokens=cache.hit_tokens,
            cache_prompt_tokens=cache.prompt_tokens,
            cache_evicted_tokens=cache.evicted_tokens,
            cache_evicted_snapshots=cache.evicted_snapshots,
            cache_tokens=cache.cached_tokens,
            cache_snapshots=cache.snapshots,
        )
    return EngineStats(
        num_running_reqs=len(scheduler.running),
        num_waiting_reqs=scheduler.num_waiting,
        num_retractions=scheduler.num_retractions,
        num_finished_reqs=num_finished_reqs,
        available_tokens=available,
        available_request_slots=slot_table.req_pool.available(),
        token_usage=1 - (available + evictable) / max(1, allocator.capacity_tokens),
        **cache_fields,
        **spec,
    )
