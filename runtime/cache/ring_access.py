# SPDX-License-Identifier: Apache-2.0
"""Addressing of position-keyed rings: per-request buffers of the last few positions' rows.

Sliding-window KV, compressor state and causal-conv state all need the rows of a bounded
number of recent positions. Each request slot owns `ring` rows; position p lives in row
`p % ring`. A ragged forward (prefill chunks of any length) reads from the virtual buffer
`[ring rows | this forward's rows]`: keys at or after the request's cached prefix come from
the current forward ("fresh"), older ones from the ring. Rings are written only after the
layer has read them, and only with each request's last `ring` positions, so a long prefill
chunk never overwrites a row it still needs. A ring longer than the read window by the
widest speculative pass means rejected draft positions are simply rewritten later: no
rollback copy. (A forward of at most that many rows per request may also write its rows
first and read everything from the ring; `deepseek_v4_metadata` does so for captured steps.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.core.forward_context import ForwardContext


@dataclass
class RingAccess:
    """Reads from `[ring rows | fresh rows]` for a set of (row, key position) pairs and the
    ring writes that follow."""

    read_idx: torch.Tensor  # [R, L] index into the virtual buffer
    read_valid: torch.Tensor  # [R, L] key position exists (>= 0)
    write_rows: torch.Tensor  # [n] fresh rows that go into the ring
    write_loc: torch.Tensor  # [n] their ring rows
    # No request has a cached prefix (a first prefill chunk): every existing key is fresh,
    # and `fresh_idx` [R, L] (the fresh row, 0 where the key does not exist) reads it
    # directly. None otherwise.
    fresh_idx: torch.Tensor | None = None
    # Otherwise the fresh keys' places in the flattened [R * L] reads and their fresh rows,
    # found once here (one host synchronisation per forward, not one per layer)
    fresh_at: torch.Tensor | None = None
    fresh_rows: torch.Tensor | None = None


def ring_access(
    ctx: ForwardContext, rows: torch.Tensor, key_pos: torch.Tensor, ring: int, ring_rows: int
) -> RingAccess:
    """`rows [R]` input rows, `key_pos [R, L]` absolute positions each of them reads;
    `ring_rows` is the ring buffer's row count (where the fresh rows start)."""
    req = ctx.token_to_req[rows].unsqueeze(1)
    prefix, start = ctx.prefix_lens[req], ctx.extend_start_loc[req]
    req_slot = ctx.req_pool_indices[req]
    valid = key_pos >= 0
    fresh = key_pos >= prefix
    ring_idx = req_slot * ring + key_pos.clamp(min=0) % ring
    read_idx = torch.where(fresh, ring_rows + start + key_pos - prefix, ring_idx)
    read_idx = read_idx.masked_fill(~valid, 0)

    all_req = ctx.token_to_req
    keep = ctx.positions >= ctx.seq_lens[all_req] - ring
    write_rows = keep.nonzero().squeeze(1)
    write_loc = ctx.req_pool_indices[all_req[write_rows]] * ring + ctx.positions[write_rows] % ring
    if not any(ctx.prefix_lens_cpu):
        fresh_idx = torch.where(valid, start + key_pos, 0)
        return RingAccess(read_idx, valid, write_rows, write_loc, fresh_idx)
    flat = read_idx.flatten()
    fresh_at = (fresh & valid).flatten().nonzero().squeeze(1)
    fresh_rows = flat.index_select(0, fresh_at) - ring_rows
    return RingAccess(read_idx, valid, write_rows, write_loc, None, fresh_at, fresh_rows)
