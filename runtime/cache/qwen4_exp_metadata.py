# SPDX-License-Identifier: Apache-2.0
"""Per-forward addressing of the Qwen4Exp caches, built before the forward runs.

The runner calls `Qwen4ExpKVPool.prepare(ctx)` once per forward (as SGLang's attention
backends split `init_forward_metadata` from the forward); every layer then reads the same
index tensors. Two layouts, as for DeepSeek-V4 (`deepseek_v4_metadata`):

* `Qwen4ExpUniformMetadata`: every request runs the same `q` rows, at most the rings'
  speculative slack; every tensor's shape is fixed by `(bs, q)` and the block count `B`
  (padded and marked dynamic by the graph runner), so a captured step replays it.
* `Qwen4ExpRaggedMetadata`: prefill chunks of any length (eager); rings are read from the
  virtual buffer `[ring | this forward's rows]` (`runtime.cache.ring_access`).

In both, QSA's block selection is described per row in its own request's block numbering
(`[rows, B]`), so selections are remembered and recalled the same way
(`Qwen4ExpKVPool.remember_selection`). Details: docs/captured_decode.md, "Module notes".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from runtime.cache.deepseek_v4_metadata import is_uniform
from runtime.cache.ring_access import RingAccess, ring_access
from runtime.core.forward_context import ForwardContext
from runtime.core.forward_mode import ForwardMode

BlockCount = Callable[[int, int], int]  # (ratio, blocks needed) -> blocks laid out


# ---------------------------------------------------------------------------------------
# Uniform rows (decode, verify, draft): fixed shapes
# ---------------------------------------------------------------------------------------


@dataclass
class UniformRing:
    """A position-keyed ring read tap by tap, after this forward's rows were written."""

    write: torch.Tensor  # [N] ring row of every new row
    read: torch.Tensor  # [N, taps] ring rows of the row's taps, oldest first
    valid: torch.Tensor  # [N, taps] tap position >= 0


@dataclass
class UniformKeys:
    """Full-history keys of each request by position, `K = B * ratio` of them."""

    key_slots: torch.Tensor  # [bs, B, ratio] token slot of each key position
    key_pos: torch.Tensor  # [B, ratio] the key positions
    key_visible: torch.Tensor  # [N, B, ratio] key <= p (causal)
    tail_keys: torch.Tensor  # [N, B, ratio] visible keys of the row's incomplete block
    block_start: torch.Tensor  # [B] first position of each block (its rope position)
    block_visible: torch.Tensor  # [N, B] block complete at the row: b < num_blocks
    num_blocks: torch.Tensor  # [N] (p + 1) // ratio: the blocks QSA's top-k runs over
    tail_start: torch.Tensor  # [N] first position of the row's incomplete block


@dataclass
class Qwen4ExpUniformMetadata:
    rows_per_req: int
    positions: torch.Tensor  # [N]
    keys: UniformKeys | None  # attention layers
    conv: UniformRing | None  # Gated DeltaNet conv inputs
    state_kept: torch.Tensor  # [bs] the recurrent state carries over (prefix > 0), else zero
    ple_tokens: UniformRing | None  # PLE n-gram token history
    ple_conv: UniformRing | None  # PLE dilated conv inputs

    @property
    def num_reqs(self) -> int:
        return self.state_kept.shape[0]

    def dynamic_dims(self) -> list[tuple[torch.Tensor, int]]:
        """(tensor, dim) pairs that grow with the context (the block count `B`)."""
        keys = self.keys
        if keys is None:
            return []
        return [
            (keys.key_slots, 1),
            (keys.key_pos, 0),
            (keys.key_visible, 1),
            (keys.tail_keys, 1),
            (keys.block_start, 0),
            (keys.block_visible, 1),
        ]


def blocks_needed(ctx: ForwardContext, ratio: int) -> int:
    """Blocks (a partial last one included) of the longest request at the end of the forward
    (one for a context built inside a captured step, whose block count comes from its
    caller)."""
    if ctx.prefix_lens_cpu is None:
        return 1
    return max(1, -(-max(ctx.seq_lens_cpu, default=0) // ratio))


@dataclass
class _Arrays:
    """The index math's inputs as numpy arrays (CPU: a fraction of torch's per-op cost at
    these sizes) or as tensors on the context's device, and how to make either a tensor.
    Only operators both libraries spell alike are applied to them."""

    slots: object  # [bs]
    positions: object  # [N]
    prefix: object  # [bs]
    req_to_token: object
    arange: Callable
    tensor: Callable

    @classmethod
    def of(cls, ctx: ForwardContext, host: bool) -> _Arrays:
        if host:
            return cls(
                ctx.req_pool_indices.numpy(),
                ctx.positions.numpy(),
                ctx.prefix_lens.numpy(),
                ctx.req_to_token.numpy(),
                np.arange,
                lambda a: torch.from_numpy(np.ascontiguousarray(a)),
            )
        device = ctx.device
        return cls(
            ctx.req_pool_indices,
            ctx.positions,
            ctx.prefix_lens,
            ctx.req_to_token,
            lambda n: torch.arange(n, device=device),
            lambda t: t.contiguous(),
        )


def uniform_ring(x: _Arrays, row_slot, taps: int, dilation: int, ring: int) -> UniformRing:
    """Ring addressing of `taps` taps `dilation` apart ending at each row's position."""
    tap_pos = x.positions[:, None] + (x.arange(taps) - (taps - 1)) * dilation
    base = row_slot * ring
    return UniformRing(
        x.tensor(base + x.positions % ring),
        x.tensor(base[:, None] + tap_pos.clip(min=0) % ring),
        x.tensor(tap_pos >= 0),
    )


def uniform_keys(ctx: ForwardContext, x: _Arrays, pool, blocks: BlockCount | None) -> UniformKeys:
    ratio = pool.layout.qsa_ratio
    count = blocks_needed(ctx, ratio)
    if blocks is not None:
        count = blocks(ratio, count)
    count = min(count, pool.max_blocks)  # every position a request may reach is covered
    key_pos = x.arange(count * ratio).reshape(count, ratio)
    in_table = key_pos.reshape(-1).clip(max=ctx.req_to_token.shape[1] - 1)
    key_slots = x.req_to_token[x.slots[:, None], in_table].reshape(ctx.batch_size, count, ratio)
    key_visible = key_pos <= x.positions[:, None, None]
    num_blocks = (x.positions + 1) // ratio
    tail_start = num_blocks * ratio
    return UniformKeys(
        key_slots=x.tensor(key_slots),
        key_pos=x.tensor(key_pos),
        key_visible=x.tensor(key_visible),
        tail_keys=x.tensor(key_visible & (key_pos >= tail_start[:, None, None])),
        block_start=x.tensor(key_pos[:, 0]),
        block_visible=x.tensor(x.arange(count) < num_blocks[:, None]),
        num_blocks=x.tensor(num_blocks),
        tail_start=x.tensor(tail_start),
    )


def uniform_metadata(
    ctx: ForwardContext, pool, blocks: BlockCount | None = None, host: bool | None = None
) -> Qwen4ExpUniformMetadata:
    """`blocks(ratio, needed)`: the block count `B` to lay out for a batch whose longest
    request spans `needed` blocks (default: exactly those). `host`: build the indices in
    numpy (default on the CPU) rather than in torch on the context's device."""
    layout = pool.layout
    x = _Arrays.of(ctx, ctx.device.type == "cpu" if host is None else host)
    q = ctx.extend_lens_cpu[0]
    row_slot = x.slots[x.arange(ctx.num_tokens) // q]
    conv = tokens = ple_conv = None
    if pool.conv_state:
        conv = uniform_ring(x, row_slot, layout.conv_kernel, 1, pool.conv_ring)
    if pool.ple_tokens:
        tokens = uniform_ring(x, row_slot, layout.ngram_size, 1, pool.token_ring)
        ple_conv = uniform_ring(
            x, row_slot, layout.ple_conv_kernel, layout.ngram_size, pool.ple_conv_ring
        )
    return Qwen4ExpUniformMetadata(
        rows_per_req=q,
        positions=ctx.positions,
        keys=uniform_keys(ctx, x, pool, blocks) if pool.k_cache else None,
        conv=conv,
        state_kept=x.tensor(x.prefix > 0),
        ple_tokens=tokens,
        ple_conv=ple_conv,
    )


# ---------------------------------------------------------------------------------------
# Ragged rows (prefill chunks)
# ---------------------------------------------------------------------------------------


@dataclass
class VisibleKeys:
    """Every key position any row of the forward may see, request by request."""

    slots: torch.Tensor  # [L] token slot of each key
    positions: torch.Tensor  # [L]
    key_req: torch.Tensor  # [L] batch index of the key's request
    allowed: torch.Tensor  # [T, L] same request and causal
    block_of_key: torch.Tensor  # [L] index into the block list; B for keys of a partial block
    block_start: torch.Tensor  # [B] first position of each complete block
    block_cols: torch.Tensor  # [T, Bmax] block list index of the row's request's block j
    block_visible: torch.Tensor  # [T, Bmax] the request's block j is complete at the row
    key_block: torch.Tensor  # [L] the key's block in its request (clamped to Bmax - 1)
    tail_start: torch.Tensor  # [T] first position of each row's incomplete tail block
    num_blocks: torch.Tensor  # [T] complete visible blocks per row
    most_blocks: int  # the largest `num_blocks` (host side)


def visible_keys(ctx: ForwardContext, ratio: int) -> VisibleKeys:
    device = ctx.device
    lens = ctx.seq_lens
    requests = torch.arange(ctx.batch_size, device=device)
    key_req = torch.repeat_interleave(requests, lens)
    key_start = torch.cumsum(lens, 0) - lens
    positions = torch.arange(sum(ctx.seq_lens_cpu), device=device) - key_start[key_req]
    slots = ctx.req_to_token[ctx.req_pool_indices[key_req], positions]
    row_req, row_pos = ctx.token_to_req, ctx.positions
    allowed = (key_req.unsqueeze(0) == row_req.unsqueeze(1)) & (
        positions.unsqueeze(0) <= row_pos.unsqueeze(1)
    )
    blocks = lens // ratio
    total = sum(n // ratio for n in ctx.seq_lens_cpu)
    most = max(ctx.seq_lens_cpu, default=0) // ratio
    block_req = torch.repeat_interleave(requests, blocks)
    block_first = torch.cumsum(blocks, 0) - blocks
    block_start = (torch.arange(total, device=device) - block_first[block_req]) * ratio
    in_complete = positions < (blocks * ratio)[key_req]
    block_of_key = torch.where(in_complete, block_first[key_req] + positions // ratio, total)
    num_blocks = (row_pos + 1) // ratio
    cols = torch.arange(max(most, 1), device=device)
    return VisibleKeys(
        slots=slots,
        positions=positions,
        key_req=key_req,
        allowed=allowed,
        block_of_key=block_of_key,
        block_start=block_start,
        block_cols=(block_first[row_req].unsqueeze(1) + cols).clamp(max=max(total - 1, 0)),
        block_visible=cols < num_blocks.unsqueeze(1),
        key_block=(positions // ratio).clamp(max=cols.shape[0] - 1),
        tail_start=num_blocks * ratio,
        num_blocks=num_blocks,
        most_blocks=most,
    )


@dataclass
class RowsByRequest:
    """Each request's rows padded to the longest: `[bs, Lmax]` row index and validity."""

    index: torch.Tensor
    valid: torch.Tensor


def rows_by_request(ctx: ForwardContext) -> RowsByRequest:
    longest = max(ctx.extend_lens_cpu, default=0)
    offsets = torch.arange(longest, device=ctx.device)
    valid = offsets.unsqueeze(0) < ctx.extend_lens.unsqueeze(1)
    index = (ctx.extend_start_loc.unsqueeze(1) + offsets).masked_fill(~valid, 0)
    return RowsByRequest(index, valid)


def conv_ring_access(
    ctx: ForwardContext, taps: int, dilation: int, ring: int, num_ring_rows: int
) -> RingAccess:
    """Ring reads of every row's `taps` taps `dilation` apart (oldest first)."""
    offsets = (torch.arange(taps, device=ctx.device) - (taps - 1)) * dilation
    rows = torch.arange(ctx.num_tokens, device=ctx.device)
    return ring_access(ctx, rows, ctx.positions.unsqueeze(1) + offsets, ring, num_ring_rows)


@dataclass
class Qwen4ExpRaggedMetadata:
    keys: VisibleKeys | None
    conv: RingAccess | None
    rows: RowsByRequest
    ple_tokens: RingAccess | None
    ple_conv: RingAccess | None


def ragged_metadata(ctx: ForwardContext, pool) -> Qwen4ExpRaggedMetadata:
    layout = pool.layout
    conv = tokens = ple_conv = None
    if pool.conv_state:
        rows = pool.req_slots * pool.conv_ring
        conv = conv_ring_access(ctx, layout.conv_kernel, 1, pool.conv_ring, rows)
    if pool.ple_tokens:
        rows = pool.req_slots * pool.token_ring
        tokens = conv_ring_access(ctx, layout.ngram_size, 1, pool.token_ring, rows)
        rows = pool.req_slots * pool.ple_conv_ring
        ple_conv = conv_ring_access(
            ctx, layout.ple_conv_kernel, layout.ngram_size, pool.ple_conv_ring, rows
        )
    return Qwen4ExpRaggedMetadata(
        keys=visible_keys(ctx, layout.qsa_ratio) if pool.k_cache else None,
        conv=conv,
        rows=rows_by_request(ctx),
        ple_tokens=tokens,
        ple_conv=ple_conv,
    )


# ---------------------------------------------------------------------------------------


def prepare_metadata(
    ctx: ForwardContext, pool, blocks: BlockCount | None = None
) -> Qwen4ExpUniformMetadata | Qwen4ExpRaggedMetadata:
    if ctx.forward_mode is not ForwardMode.EXTEND and is_uniform(ctx, pool.max_pass):
        return uniform_metadata(ctx, pool, blocks)
    return ragged_metadata(ctx, pool)
