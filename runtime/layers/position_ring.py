# SPDX-License-Identifier: Apache-2.0
"""Position-keyed rings: per-request buffers of the last few positions' rows.

Sliding-window KV, compressor state and causal-conv state all need the rows of a bounded
number of recent positions. Each request slot owns `ring` rows; position p lives in row
`p % ring`. A forward reads from the virtual buffer `[ring rows | this forward's rows]`:
keys at or after the request's cached prefix come from the current forward ("fresh"),
older ones from the ring. Rings are written only after the layer has read them, and only
with each request's last `ring` positions, so a long prefill chunk never overwrites a row
it still needs. A ring longer than the read window by the widest speculative pass means
rejected draft positions are simply rewritten later: no rollback copy.
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


def ring_access(
    ctx: ForwardContext, rows: torch.Tensor, key_pos: torch.Tensor, ring: int, ring_rows: int
) -> RingAccess:
    """`rows [R]` input rows, `key_pos [R, L]` absolute positions each of them reads."""
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
    return RingAccess(read_idx, valid, write_rows, write_loc)


def gather_ring(
    ring_buf: torch.Tensor, fresh: torch.Tensor, read_idx: torch.Tensor
) -> torch.Tensor:
    """Rows of the virtual buffer `[ring_buf | fresh]`: `[R, L, D]`."""
    num_ring = ring_buf.shape[0]
    out = ring_buf[read_idx.clamp(max=num_ring - 1)]
    from_fresh = read_idx >= num_ring
    if from_fresh.any():
        out[from_fresh] = fresh[read_idx[from_fresh] - num_ring].to(out.dtype)
    return out
