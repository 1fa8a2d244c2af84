# SPDX-License-Identifier: Apache-2.0
"""Reads of position-keyed rings in a ragged forward (addressing: `runtime.cache.ring_access`).

A ragged forward reads each key either from the request's ring (positions cached before
this forward) or from this forward's own rows; `gather_ring` takes both at once.
"""

from __future__ import annotations

import torch

from runtime.cache.ring_access import RingAccess
from runtime.kernels.row_gather import take_rows


def gather_ring(ring_buf: torch.Tensor, fresh: torch.Tensor, access: RingAccess) -> torch.Tensor:
    """Rows of the virtual buffer `[ring_buf | fresh]` at `access.read_idx`: `[R, L, D]`
    (rows of keys that do not exist are arbitrary; callers mask them by `read_valid`).
    When no request has a cached prefix, every key is one of this forward's rows: one
    gather, with no host synchronisation."""
    if access.fresh_idx is not None:
        return take_rows(fresh, access.fresh_idx).to(ring_buf.dtype)
    read_idx = access.read_idx
    num_ring = ring_buf.shape[0]
    out = take_rows(ring_buf, read_idx.clamp(max=num_ring - 1))
    from_fresh = read_idx >= num_ring
    if from_fresh.any():
        out[from_fresh] = fresh[read_idx[from_fresh] - num_ring].to(out.dtype)
    return out
