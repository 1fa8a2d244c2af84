# SPDX-License-Identifier: Apache-2.0
"""Attention over a per-row gathered key set, with a learned per-head sink.

`q [T, H, D]`, `kv [T, K, D]` (keys and values are the same latent, as in DeepSeek-V4's
single-latent MQA), `valid [T, K]`, `sink [H]`. For each row and head:
    z_i = scale * q . k_i                      (invalid i masked out)
    o   = sum_i exp(z_i - m) k_i / (sum_i exp(z_i - m) + exp(sink - m))
The sink only adds to the denominator. Softmax statistics are fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kernels import cpu_extension, dense_product
from runtime.kernels.row_gather import take_rows


def sink_attention_reference(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    scores = torch.bmm(q.float(), kv.float().transpose(1, 2)) * scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink = sink.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.bmm(probs, kv.float()).to(q.dtype)


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    if q.dtype == torch.float32:
        return sink_attention_reference(q, kv, valid, sink, scale)
    # Low-precision inputs: products in the input dtype, statistics in fp32.
    scores = torch.bmm(q, kv.transpose(1, 2)).float() * scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink = sink.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.bmm(probs.to(q.dtype), kv)


def mask_bias(valid: torch.Tensor) -> torch.Tensor:
    """`valid` as an additive fp32 bias: 0 where true, -inf where false. Adding it equals
    `masked_fill(~valid, -inf)` exactly (x + 0 = x), and adding a bias broadcast over the
    heads is several times faster on CPU than a masked fill with a broadcast mask."""
    return torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill_(
        ~valid, float("-inf")
    )


@dataclass(frozen=True)
class TileKeys:
    """The keys of prefill rows laid out in tiles of `R` consecutive rows: keys shared by a
    tile's rows, and (optionally) keys of each row alone, either gathered (`row_kv`) or as
    rows of a cache (`row_source[row_index]`, read where they lie by the CPU kernel)."""

    rows: torch.Tensor  # [N, R] the rows of each tile (`T` pads a short tile)
    row_slot: torch.Tensor  # [T] each row's index in the flattened [N * R] tile layout
    kv: torch.Tensor  # [N, Kt, D] keys shared by a tile's rows
    valid: torch.Tensor  # [N, R, Kt]
    row_kv: torch.Tensor | None = None  # [T, Kr, D] keys of each row alone
    row_valid: torch.Tensor | None = None  # [T, Kr]
    row_source: torch.Tensor | None = None  # [P, D] with row_index: instead of row_kv
    row_index: torch.Tensor | None = None  # [T, Kr] rows of row_source

    def own_keys(self) -> torch.Tensor | None:
        """`[T, Kr, D]` keys of each row alone (gathered from the source if need be)."""
        if self.row_kv is None and self.row_index is not None:
            return take_rows(self.row_source, self.row_index)
        return self.row_kv

    def unpack(self):
        return self.rows, self.row_slot, self.kv, self.valid, self.own_keys(), self.row_valid


def to_tiles(rows: torch.Tensor, tile_rows: torch.Tensor) -> torch.Tensor:
    """Per-row `[T, ...]` -> per-tile `[N, R, ...]` (`tile_rows [N, R]` the row of each tile
    lane, `T` for a short tile's padding lane, which reads zeros)."""
    return take_rows(torch.cat([rows, rows.new_zeros(1, *rows.shape[1:])]), tile_rows)


# PyTorch's fused CPU attention kernel, which also returns each row's log-sum-exp
HAS_CPU_FLASH = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def tiled_sink_attention(
    q: torch.Tensor, keys: TileKeys, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Sink attention whose keys come in two parts: keys shared by a tile of rows, and keys
    of each row alone. Same result as `sink_attention` on the concatenation
    `[tile_kv[tile of row] | row_kv[row]]` with the concatenated masks.

    A prefill row reads the window of the positions before it; its neighbours read almost
    the same window. Gathering it once per tile of `R` consecutive rows instead of once per
    row cuts the gathered keys by about `R` (the tile's window is `R - 1` keys longer).

    `q [T, H, D]`, the keys as `TileKeys`. Products run in the input dtype, softmax
    statistics in fp32.

    On CPU the shared keys go through a fused pass that returns each row's log-sum-exp
    (`tiled_sink_attention_flash`: the project's tile-attention kernel, or PyTorch's
    flash-attention kernel); elsewhere, and where that kernel is missing, through two
    batched products around a softmax (`tiled_sink_attention_bmm`)."""
    if q.device.type == "cpu" and HAS_CPU_FLASH:
        return tiled_sink_attention_flash(q, keys, sink, scale)
    return tiled_sink_attention_bmm(q, keys, sink, scale)


def tiled_sink_attention_flash(
    q: torch.Tensor, keys: TileKeys, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """`tiled_sink_attention` with the tile's keys in one fused pass that never writes the
    `[N, R, H, K]` scores and returns each row's log-sum-exp `l` beside its output `o`
    (normalised over the tile's keys alone): the project's `nextn_cpu::tile_attention`
    where the C++ kernels serve (fp32), else PyTorch's CPU flash-attention kernel
    (`tile_keys_attention`). The sink and the row's own keys then join through the
    log-sum-exp, as flash-decoding merges the partial results of key splits (Dao et al.):

        L = log(exp(l) + sum_j exp(z_j) + exp(sink))      z_j the row's own scores
        out = o * exp(l - L) + sum_j exp(z_j - L) v_j

    With no own keys this is `o * sigmoid(l - sink)`. A row that sees no tile key gets
    `l = -inf`. Statistics are fp32 in the kernels and here.
    """
    heads, dim = q.shape[1:]
    out, lse = tile_keys_attention(q, keys, scale)
    if keys.row_kv is None and keys.row_index is None:
        sink = sink.float().view(1, heads)
        return (out.float() * torch.sigmoid(lse - sink).unsqueeze(-1)).to(q.dtype)
    if keys.row_index is not None:
        source, index = keys.row_source, keys.row_index
    else:  # gathered keys: row t's are rows t * Kr .. (t + 1) * Kr of the flattened copy
        own = keys.row_kv.shape[1]
        source = keys.row_kv.reshape(-1, dim)
        index = torch.arange(source.shape[0], device=q.device).view(-1, own)
    merged = merge_row_keys(out.float(), lse, q.float(), source, index, keys.row_valid, sink, scale)
    return merged.to(q.dtype)


def tile_keys_attention(
    q: torch.Tensor, keys: TileKeys, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's attention over its tile's keys alone: `(o [T, H, D], l [T, H])`, `o`
    normalised over those keys and `l` their log-sum-exp (`-inf` where the row sees none).

    Eagerly on CPU with the C++ kernels loaded and fp32 inputs, `nextn_cpu::tile_attention`:
    a tile's `R x H` queries (all heads of its rows share the single latent) times its keys
    in one GEMM, the masked softmax in place, the output in a second GEMM. Otherwise
    PyTorch's fused flash-attention kernel (`aten::_scaled_dot_product_flash_attention_for_cpu`),
    each tile one batch entry, its rows the queries of each head, the latent both key and
    value broadcast over the heads (a stride-0 view, no copy). That kernel multiplies head
    by head (`[R, D] x [D, K]` per head and tile), small products; the C++ kernel folds the
    heads into one larger GEMM per tile (docs/captured_decode.md section 7)."""
    tile_rows, row_slot, tile_kv, tile_valid = keys.rows, keys.row_slot, keys.kv, keys.valid
    num_tiles, tile_len = tile_rows.shape
    heads, dim = q.shape[1:]
    if (
        q.dtype == torch.float32
        and tile_kv.dtype == torch.float32
        and cpu_extension.serves_eagerly(q)
    ):
        out, lse = torch.ops.nextn_cpu.tile_attention(
            q, tile_rows, tile_kv, tile_valid, scale, dense_product.enabled()
        )
    else:
        shared = tile_kv.unsqueeze(1).expand(num_tiles, heads, tile_kv.shape[1], dim)
        bias = mask_bias(tile_valid).unsqueeze(1)  # [N, 1, R, K]: one mask for all heads
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            to_tiles(q, tile_rows).transpose(1, 2), shared, shared, attn_mask=bias, scale=scale
        )
        lse = lse.masked_fill(~tile_valid.any(-1).unsqueeze(1), float("-inf"))  # [N, H, R]
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    out = take_rows(out.reshape(num_tiles * tile_len, heads, dim), row_slot)
    return out, take_rows(lse.reshape(num_tiles * tile_len, heads), row_slot)


def merge_row_keys_reference(
    tile_out: torch.Tensor,
    tile_lse: torch.Tensor,
    q: torch.Tensor,
    source: torch.Tensor,
    index: torch.Tensor,
    valid: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each row's own keys `source[index[t]]` (masked by `valid [T, Kr]`) merged into its
    attention over its tile's keys (`tile_out [T, H, D]`, `tile_lse [T, H]`), with the
    sink, through the log-sum-exp (`tiled_sink_attention_flash`'s formula), in fp32:
    `[T, H, D]`. The rows' own keys are few, and CPU products of bf16 batches this small
    are several times slower than fp32 ones."""
    heads = q.shape[1]
    row_kv = take_rows(source, index).float()
    row_scores = torch.bmm(q.float(), row_kv.transpose(1, 2)).mul_(scale)
    row_scores = row_scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))  # [T, H, Kr]
    sink = sink.float().view(1, heads)
    parts = [
        tile_lse.unsqueeze(-1),
        row_scores,
        sink.expand(tile_lse.shape[0], heads).unsqueeze(-1),
    ]
    total = torch.logsumexp(torch.cat(parts, dim=-1), dim=-1, keepdim=True)  # [T, H, 1]
    own = torch.bmm(torch.exp(row_scores - total), row_kv)
    return tile_out.float() * torch.exp(tile_lse.unsqueeze(-1) - total) + own


def merge_row_keys(
    tile_out: torch.Tensor,
    tile_lse: torch.Tensor,
    q: torch.Tensor,
    source: torch.Tensor,
    index: torch.Tensor,
    valid: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`merge_row_keys_reference`; eagerly on CPU with the C++ kernels loaded, their
    `nextn_cpu::merge_row_keys`, which reads each row's keys from `source` where they lie
    (prefetching the next row's) instead of gathering a `[T, Kr, D]` copy first: in a
    prefill of 2,048 rows that copy and its products cost about a tenth of the step."""
    if source.dtype in (torch.float32, torch.bfloat16) and cpu_extension.serves_eagerly(q):
        return torch.ops.nextn_cpu.merge_row_keys(
            tile_out.float(), tile_lse.float(), q.float(), source, index, valid, sink.float(), scale
        )
    return merge_row_keys_reference(tile_out, tile_lse, q, source, index, valid, sink, scale)


def tiled_sink_attention_bmm(
    q: torch.Tensor, keys: TileKeys, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """`tiled_sink_attention` as two batched products around a softmax. The scores and
    probabilities (`[N, R, H, K]`, the large tensors) stay in the tile layout from the
    product to the softmax and back into the second product; only the queries go in and
    the outputs come out through the row <-> tile gathers. A padding row of a short tile
    sees no key (its scores are all masked, so its probabilities are the sink's alone) and
    its output is dropped.
    """
    tile_rows, row_slot, tile_kv, tile_valid, row_kv, row_valid = keys.unpack()
    heads, dim = q.shape[1:]
    num_tiles, tile_len = tile_rows.shape
    width = tile_kv.shape[1]
    tile_q = to_tiles(q, tile_rows)  # [N, R, H, D]
    if row_kv is None:
        # The sink as one more key: a zero key scores exactly 0, to which the sink logit is
        # added, and adds exactly nothing to the output; the scores are written once,
        # already in the softmax's layout (no concatenation of [N, R, H, K] tensors).
        tile_kv = torch.cat([tile_kv, tile_kv.new_zeros(num_tiles, 1, dim)], dim=1)
    scores = torch.bmm(tile_q.view(num_tiles, tile_len * heads, dim), tile_kv.transpose(1, 2))
    scores = scores.float().mul_(scale).view(num_tiles, tile_len, heads, -1)
    scores[..., :width].add_(mask_bias(tile_valid).unsqueeze(2))  # one mask for all heads
    if row_kv is None:
        scores[..., width].add_(sink.float())
        probs = torch.softmax(scores, dim=-1).to(q.dtype)  # [N, R, H, K + 1]
        out = torch.bmm(probs.view(num_tiles, tile_len * heads, -1), tile_kv)
        return out.view(num_tiles * tile_len, heads, dim)[row_slot]
    row_scores = torch.bmm(q, row_kv.transpose(1, 2)).float().mul_(scale)
    row_scores = row_scores.masked_fill_(~row_valid.unsqueeze(1), float("-inf"))
    pad = row_scores.new_full((1, heads, row_scores.shape[-1]), float("-inf"))
    parts = [scores, torch.cat([row_scores, pad])[tile_rows]]  # [N, R, H, Kr]
    parts.append(sink.float().view(1, 1, -1, 1).expand(num_tiles, tile_len, -1, 1))
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1).to(q.dtype)  # [N, R, H, K + 1]
    shared = probs[..., :width].reshape(num_tiles, tile_len * heads, width)
    out = torch.bmm(shared, tile_kv).view(num_tiles * tile_len, heads, dim)[row_slot]
    own = probs[..., width:-1].reshape(num_tiles * tile_len, heads, -1)[row_slot]
    return out + torch.bmm(own, row_kv)


def grouped_sink_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    valid: torch.Tensor,
    row_kv: torch.Tensor | None,
    row_valid: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`tiled_sink_attention` for groups of equally many rows (every request of a uniform
    batch runs `R` rows), with no index tensors: shapes fix everything.

    `q [B, R, H, D]`; `kv [B, K, D]` keys shared by the group's rows with `valid [B, R, K]`;
    `row_kv [B * R, Kr, D]` keys of each row alone with `row_valid [B * R, Kr]` (or None).
    Returns `[B * R, H, D]`.

    On CPU with the C++ kernels loaded, fp32 and no grad wanted, eagerly and in captured
    steps alike: `nextn_cpu::group_attention`, one pass per group with the scores, the
    softmax and the output in the core's cache, every query's sums in one order whatever
    the batch and rows per group (docs/captured_decode.md section 3). Otherwise
    `grouped_sink_attention_bmm`.
    """
    if _kernel_serves(q, kv, row_kv):
        return torch.ops.nextn_cpu.group_attention(
            q, kv, valid, row_kv, row_valid, sink.float(), scale
        )
    return grouped_sink_attention_bmm(q, kv, valid, row_kv, row_valid, sink, scale)


def _kernel_serves(q: torch.Tensor, kv: torch.Tensor, row_kv: torch.Tensor | None) -> bool:
    return (
        cpu_extension.serves(q)
        and q.dtype == kv.dtype == torch.float32
        and (row_kv is None or row_kv.dtype == torch.float32)
    )


def grouped_sink_attention_bmm(
    q: torch.Tensor,
    kv: torch.Tensor,
    valid: torch.Tensor,
    row_kv: torch.Tensor | None,
    row_valid: torch.Tensor | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`grouped_sink_attention` as batched products around a softmax (any dtype, device,
    grad)."""
    groups, rows, heads, dim = q.shape
    width = kv.shape[1]
    scores = torch.bmm(q.reshape(groups, rows * heads, dim), kv.transpose(1, 2)).float() * scale
    scores = scores.view(groups, rows, heads, width).masked_fill(~valid.unsqueeze(2), float("-inf"))
    parts = [scores.view(groups * rows, heads, width)]
    flat_q = q.reshape(groups * rows, heads, dim)
    if row_kv is not None:
        row_scores = torch.bmm(flat_q, row_kv.transpose(1, 2)).float() * scale
        parts.append(row_scores.masked_fill(~row_valid.unsqueeze(1), float("-inf")))
    parts.append(sink.float().view(1, -1, 1).expand(groups * rows, -1, 1))
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1).to(q.dtype)
    shared = probs[..., :width].reshape(groups, rows * heads, width)
    out = torch.bmm(shared, kv).view(groups * rows, heads, dim)
    if row_kv is not None:
        out = out + torch.bmm(probs[..., width:-1], row_kv)
    return out
