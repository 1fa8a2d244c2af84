# SPDX-License-Identifier: Apache-2.0
"""Qwen4Exp cache buffers (target and MTP draft).

* attention layers: K and V per full-history token slot, plus the raw QSA index key.
* Gated DeltaNet layers: the causal-conv inputs in a position-keyed ring, and the recurrent
  state (fp32) in one row per request. A verify pass writes the state after each of its
  rows to `ssm_snapshots`; `commit_verified` copies the accepted one into the state.
* PLE layers: the token ring (n-gram context) and the conv-input ring.
* the draft's attention layer remembers, per request, the QSA blocks its first step chose
  (`remember_selection` / `recall_selection`), for its later chained steps.

Everything else is keyed by position, so rejected speculative positions are just rewritten.
`prepare` builds each forward's addressing before it runs (`qwen4_exp_metadata`): fixed
shapes for decode, verify and draft steps, which graphs capture.

Every buffer also holds the padding request's rows and the scratch page's token slots
(`PoolGeometry.req_slots`, `cache_pages`): rows that pad a captured batch read and write
only there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.cache.pool_geometry import PoolGeometry
from runtime.cache.qwen4_exp_metadata import (
    BlockCount,
    Qwen4ExpUniformMetadata,
    prepare_metadata,
    uniform_metadata,
)
from runtime.cache.state_snapshots import RequestStateSnapshots
from runtime.core.forward_context import ForwardContext


@dataclass(frozen=True)
class Qwen4ExpCacheLayout:
    layer_kinds: tuple[str, ...]  # "linear" or "attention", per cache layer
    ple_layers: tuple[int, ...]  # cache layers hosting PLE
    num_kv_heads: int
    head_dim: int
    index_head_dim: int
    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    hc_width: int  # n * H
    ple_conv_span: int  # (kernel - 1) * dilation
    ngram_size: int
    qsa_ratio: int

    @property
    def ple_conv_kernel(self) -> int:
        """Taps of PLE's dilated conv (`ngram_size` apart)."""
        return self.ple_conv_span // max(self.ngram_size, 1) + 1


class Qwen4ExpKVPool(RequestStateSnapshots):
    def __init__(
        self,
        layout: Qwen4ExpCacheLayout,
        geometry: PoolGeometry,
        reuses_qsa_selection: bool = False,
    ):
        dtype, device = geometry.dtype, geometry.device
        max_tokens_per_pass = geometry.max_tokens_per_pass
        self.layout, self.dtype, self.device = layout, dtype, device
        self.max_reqs, self.max_pass = geometry.max_reqs, max_tokens_per_pass
        self.req_slots = max_reqs = geometry.req_slots  # the padding request's rows included
        self.reuses_qsa_selection = reuses_qsa_selection
        self.page_size = geometry.page_size
        slots = geometry.cache_pages * geometry.page_size  # the scratch page included
        self.conv_ring = layout.conv_kernel - 1 + max_tokens_per_pass
        self.token_ring = layout.ngram_size - 1 + max_tokens_per_pass
        self.ple_conv_ring = layout.ple_conv_span + max_tokens_per_pass

        def zeros(*shape, dt=dtype):
            return torch.zeros(shape, dtype=dt, device=device)

        kinds = layout.layer_kinds
        self.k_cache = {
            i: zeros(slots, layout.num_kv_heads, layout.head_dim)
            for i, k in enumerate(kinds)
            if k == "attention"
        }
        self.v_cache = {i: zeros(slots, layout.num_kv_heads, layout.head_dim) for i in self.k_cache}
        self.index_cache = {i: zeros(slots, layout.index_head_dim) for i in self.k_cache}
        linear = [i for i, k in enumerate(kinds) if k == "linear"]
        state = (layout.num_v_heads, layout.head_k_dim, layout.head_v_dim)
        self.conv_state = {i: zeros(max_reqs * self.conv_ring, layout.conv_dim) for i in linear}
        self.ssm_state = {i: zeros(max_reqs, *state, dt=torch.float32) for i in linear}
        self.ssm_snapshots = {
            i: zeros(max_reqs, max_tokens_per_pass, *state, dt=torch.float32) for i in linear
        }
        self.ple_tokens = {
            i: zeros(max_reqs * self.token_ring, dt=torch.long) for i in layout.ple_layers
        }
        self.ple_conv = {
            i: zeros(max_reqs * self.ple_conv_ring, layout.hc_width) for i in layout.ple_layers
        }
        # every position a pass can touch, a partial last block included
        self.max_blocks = max(1, -(-geometry.max_context // max(layout.qsa_ratio, 1)))
        self.qsa_blocks = (
            {i: zeros(max_reqs, self.max_blocks, dt=torch.bool) for i in self.k_cache}
            if reuses_qsa_selection
            else {}
        )
        self.qsa_tail = (
            {i: zeros(max_reqs, dt=torch.long) for i in self.k_cache}
            if reuses_qsa_selection
            else {}
        )

    # per-forward metadata -----------------------------------------------------------------
    capturable = True  # uniform batches have fixed-shape metadata (`prepare`)

    def prepare(self, ctx: ForwardContext, blocks: BlockCount | None = None):
        """The addressing every layer of this forward reads (`qwen4_exp_metadata`);
        `blocks(ratio, needed)` pads the key block count of a uniform batch."""
        return prepare_metadata(ctx, self, blocks)

    def prepare_in_step(
        self, ctx: ForwardContext, like: Qwen4ExpUniformMetadata
    ) -> Qwen4ExpUniformMetadata:
        """The uniform addressing of `ctx`, built inside a captured step from its tensors
        (positions computed in the step; torch ops only), laid out with the key block count
        of `like`, metadata the same step received (whose count covers `ctx`'s positions)."""
        count = None if like.keys is None else like.keys.block_start.shape[0]
        return uniform_metadata(ctx, self, lambda ratio, _: count, host=False)

    # speculative decoding -----------------------------------------------------------------
    def commit_verified(self, req_pool_indices: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Keep the recurrent state after the last accepted verify row (`num_accepted` drafts
        accepted = row `num_accepted`)."""
        slots = torch.as_tensor(req_pool_indices, dtype=torch.long, device=self.device)
        rows = torch.as_tensor(num_accepted, dtype=torch.long, device=self.device)
        for layer, snapshots in self.ssm_snapshots.items():
            self.ssm_state[layer][slots] = snapshots[slots, rows]

    # prefix cache -------------------------------------------------------------------------
    def share_alignment(self) -> int:
        """Every full-history row belongs to one token slot: any page boundary will do."""
        return 1

    def request_state(self, req_pool_idx: int, verify_row: int | None = None) -> list:
        """Views of everything kept per request rather than per token slot: the conv and PLE
        rings and the recurrent state. `verify_row` j reads the recurrent state after row j of
        the last verify pass (`ssm_snapshots`) instead of the committed one. The draft's QSA
        selection is left out: each draft round chooses it afresh."""
        slot = req_pool_idx
        views = [
            buf[slot * self.conv_ring : (slot + 1) * self.conv_ring]
            for buf in self.conv_state.values()
        ]
        for layer, state in self.ssm_state.items():
            views.append(
                state[slot] if verify_row is None else self.ssm_snapshots[layer][slot, verify_row]
            )
        views += [
            buf[slot * self.token_ring : (slot + 1) * self.token_ring]
            for buf in self.ple_tokens.values()
        ]
        views += [
            buf[slot * self.ple_conv_ring : (slot + 1) * self.ple_conv_ring]
            for buf in self.ple_conv.values()
        ]
        return views

    def copy_pages(self, src_pages: list[int], dst_pages: list[int]) -> None:
        """Copy the per-slot rows (K, V, raw QSA index keys) of whole pages."""
        src, dst = self._page_slots(src_pages), self._page_slots(dst_pages)
        for group in (self.k_cache, self.v_cache, self.index_cache):
            for buf in group.values():
                buf[dst] = buf[src]

    def _page_slots(self, pages: list[int]) -> torch.Tensor:
        base = torch.tensor(pages, dtype=torch.long, device=self.device) * self.page_size
        return (base.unsqueeze(1) + torch.arange(self.page_size, device=self.device)).flatten()

    def remember_selection(
        self, layer: int, ctx: ForwardContext, selected: torch.Tensor, tail_start: torch.Tensor
    ) -> None:
        """Store, per request, the blocks chosen at its logits row (the draft's first step):
        `selected [T, B]` in the request's block numbering, `tail_start [T]`. Columns past
        `B` keep older values; they lie past the tail, which recall keeps whole anyway."""
        rows = ctx.logits_row_indices
        slots = ctx.req_pool_indices[ctx.token_to_req[rows]]
        self.qsa_blocks[layer][slots, : selected.shape[1]] = selected[rows]
        self.qsa_tail[layer][slots] = tail_start[rows]

    def recall_selection(self, layer: int, ctx: ForwardContext, key_pos: torch.Tensor):
        """Key mask `[bs, B, ratio]` of each request's keys laid out by position
        (`key_pos [B, ratio]`): the remembered blocks, and every position from the first
        step's tail on (which includes the new draft positions)."""
        slots = ctx.req_pool_indices
        blocks = self.qsa_blocks[layer][slots, : key_pos.shape[0]]
        after_tail = key_pos >= self.qsa_tail[layer][slots].view(-1, 1, 1)
        return blocks.unsqueeze(-1) | after_tail

    # reporting ----------------------------------------------------------------------------
    def _buffers(self):
        for group in (
            self.k_cache,
            self.v_cache,
            self.index_cache,
            self.conv_state,
            self.ssm_state,
            self.ssm_snapshots,
            self.ple_tokens,
            self.ple_conv,
            self.qsa_blocks,
            self.qsa_tail,
        ):
            yield from group.values()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers())

    def describe(self) -> str:
        kinds = self.layout.layer_kinds
        return (
            f"Qwen4Exp cache: {kinds.count('attention')} attention + "
            f"{kinds.count('linear')} Gated DeltaNet layers, {len(self.layout.ple_layers)} PLE, "
            f"{self.nbytes() / 2**20:.1f} MiB"
        )
