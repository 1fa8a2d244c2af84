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
    gather. Otherwise a gather from the ring, whose fresh places are then overwritten by a
    row copy at the places the metadata found (`fresh_at`): no host synchronisation and no
    element-wise masked indexing here, which was slower."""
    if access.fresh_idx is not None:
        return take_rows(fresh, access.fresh_idx).to(ring_buf.dtype)
    out = take_rows(ring_buf, access.read_idx.clamp(max=ring_buf.shape[0] - 1))
    if access.fresh_at.numel():
        rows = take_rows(fresh, access.fresh_rows).to(out.dtype)
        out.view(-1, *out.shape[2:]).index_copy_(0, access.fresh_at, rows)
    return out
