# SPDX-License-Identifier: Apache-2.0
"""The per-forward description a model reads.

The scheduler (or the speculative worker) decides *which* tokens run; the `ModelRunner`
turns that into a `ForwardContext` once per forward. Models read the batch layout and
cache accessors from it and nothing else: no weights, no scheduler objects. Attention
metadata that every layer shares (slot mappings, gather indices) is prepared by the runner
before the forward (`attn_metadata`, from the cache pool's `prepare`); no layer builds its
own addressing inside the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.core.kv_pool import KVPool


@dataclass
class ForwardContext:
    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor  # [bs] rows of the request-to-token table
    prefix_lens: torch.Tensor  # [bs] tokens already in the cache before this forward
    extend_lens: torch.Tensor  # [bs] tokens this forward adds per request
    prefix_lens_cpu: list[int] | None  # None: computed inside a captured step (`decode_rows`)
    extend_lens_cpu: list[int]
    positions: torch.Tensor  # [T] absolute position of every input row
    token_to_req: torch.Tensor  # [T] batch index of every input row
    extend_start_loc: torch.Tensor  # [bs] first input row of each request
    out_cache_loc: torch.Tensor  # [T] full-history token slot of every input row
    req_to_token: torch.Tensor  # [max_reqs, max_context] token slots (shared table)
    kv_pool: KVPool  # the model's cache pool (a family's layers narrow it to its type)
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    logits_row_indices: torch.Tensor | None = None  # [R] rows to compute logits for; None = all
    attn_metadata: Any = None  # the pool's per-forward addressing, prepared before the forward

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens

    @property
    def seq_lens_cpu(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu)]

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @classmethod
    def build(
        cls,
        forward_mode: ForwardMode,
        req_pool_indices: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        out_cache_loc: torch.Tensor | None,
        req_to_token: torch.Tensor,
        kv_pool: KVPool,
        capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL,
        logits_row_indices: torch.Tensor | Sequence[int] | None = None,
    ) -> ForwardContext:
        """Derive positions and row bookkeeping from per-request (prefix, extend) lengths.

        `out_cache_loc=None` reads each row's slot from `req_to_token` (the slots must have
        been reserved already)."""
        device = req_to_token.device
        prefix_cpu, extend_cpu = [int(x) for x in prefix_lens], [int(x) for x in extend_lens]
        slots_cpu = [int(x) for x in req_pool_indices]
        if len(prefix_cpu) != len(extend_cpu) or len(prefix_cpu) != len(slots_cpu):
            raise ValueError(
                "req_pool_indices, prefix_lens and extend_lens must have one entry per request"
            )
        bs = len(prefix_cpu)
        num_tokens = sum(extend_cpu)
        if out_cache_loc is not None and out_cache_loc.shape[0] != num_tokens:
            raise ValueError(
                f"out_cache_loc has {out_cache_loc.shape[0]} slots for {num_tokens} tokens"
            )
        # host index math in numpy (a fraction of torch's per-op cost at these sizes)
        slots, prefix = np.asarray(slots_cpu, np.int64), np.asarray(prefix_cpu, np.int64)
        extend = np.asarray(extend_cpu, np.int64)
        token_to_req = np.repeat(np.arange(bs, dtype=np.int64), extend)
        start_loc = np.cumsum(extend) - extend
        positions = prefix[token_to_req] + np.arange(num_tokens) - start_loc[token_to_req]

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        req_pool_indices = tensor(slots)
        token_to_req_t, positions_t = tensor(token_to_req), tensor(positions)
        if out_cache_loc is None:
            out_cache_loc = req_to_token[req_pool_indices[token_to_req_t], positions_t]
        if isinstance(logits_row_indices, Sequence):
            logits_row_indices = tensor(np.asarray(logits_row_indices, np.int64).reshape(-1))
        return cls(
            forward_mode=forward_mode,
            batch_size=bs,
            req_pool_indices=req_pool_indices,
            prefix_lens=tensor(prefix),
            extend_lens=tensor(extend),
            prefix_lens_cpu=prefix_cpu,
            extend_lens_cpu=extend_cpu,
            positions=positions_t,
            token_to_req=token_to_req_t,
            extend_start_loc=tensor(start_loc),
            out_cache_loc=out_cache_loc,
            req_to_token=req_to_token,
            kv_pool=kv_pool,
            capture_hidden_mode=capture_hidden_mode,
            logits_row_indices=logits_row_indices,
        )

    @classmethod
    def decode_rows(
        cls,
        req_pool_indices: torch.Tensor,
        positions: torch.Tensor,
        req_to_token: torch.Tensor,
        kv_pool: KVPool,
        capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL,
    ) -> ForwardContext:
        """One decode row per request at `positions [bs]`, from tensors alone: a captured
        step builds it for positions it computed itself (a chained draft step after the
        acceptance of a fused NEXTN round), so no host copy of the lengths exists."""
        bs = req_pool_indices.shape[0]
        rows = torch.arange(bs, device=positions.device)
        return cls(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            req_pool_indices=req_pool_indices,
            prefix_lens=positions,
            extend_lens=torch.ones_like(positions),
            prefix_lens_cpu=None,
            extend_lens_cpu=[1] * bs,
            positions=positions,
            token_to_req=rows,
            extend_start_loc=rows,
            out_cache_loc=req_to_token[req_pool_indices, positions],
            req_to_token=req_to_token,
            kv_pool=kv_pool,
            capture_hidden_mode=capture_hidden_mode,
        )

    def last_row_per_request(self) -> torch.Tensor:
        """[bs] index of each request's last input row (its next-token row in prefill)."""
        return self.extend_start_loc + self.extend_lens - 1
