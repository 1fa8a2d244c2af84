# SPDX-License-Identifier: Apache-2.0
"""Top-k of the DeepSeek-V4 lightning indexer and of Qwen4Exp's QSA block selection, with
exact ties broken as transformers does.

`scores [N, C]` (entries a row may not see already `-inf`), `visible [N]` entries each row
sees, `lengths [N]` how many entries the reference's `topk` runs over for that row (as in
transformers' `DeepseekV4Indexer` and `Qwen4ExpTextQSAIndexer`). Returns
`(indices [N, k], valid [N, k])`, indices ascending, an index valid iff it is below
`visible`; `C < k` is padded. A row's choice depends only on its own `lengths` entry, never
on the batch around it or on padding: speculative verify, batched unlike plain decode,
relies on that. It is a custom op with a fake implementation (one opaque node of fixed
output shape); inside CUDA graph capture the host-side tie fix-up is skipped (CUDA's
`topk` breaks ties its own way anyway).
How `lengths` follows the reference and how ties are resolved: docs/architecture.md,
"Module notes".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.core.capture import in_capture
from runtime.kernels import cpu_extension


def indexer_topk_reference(
    scores: torch.Tensor, lengths: torch.Tensor, visible: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, as transformers does it (the test oracle)."""
    rows = []
    for row, length in zip(scores, lengths.tolist()):
        picked = row[:length].topk(min(k, length)).indices if length else row[:0].long()
        rows.append(F.pad(picked.sort().values, (0, k - picked.numel()), value=scores.shape[1]))
    indices = torch.stack(rows) if rows else scores.new_zeros((0, k), dtype=torch.long)
    return indices, indices < visible.unsqueeze(1)


def indexer_topk(
    scores: torch.Tensor, lengths: torch.Tensor, visible: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op (see the module docstring). Captured on CPU with the C++ kernels loaded it is
    their `nextn_cpu::indexer_topk`, the same ATen calls without a Python callback from the
    compiled step; otherwise the Python custom op."""
    if scores.device.type == "cpu" and in_capture() and cpu_extension.available():
        return torch.ops.nextn_cpu.indexer_topk(scores, lengths, visible, k)
    return indexer_topk_op(scores, lengths, visible, k)


@torch.library.custom_op("nextn::indexer_topk", mutates_args=())
def indexer_topk_op(
    scores: torch.Tensor, lengths: torch.Tensor, visible: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows, width = scores.shape
    if width <= k:  # everything fits: the selection is every entry (padded to k)
        indices = torch.arange(k, device=scores.device).expand(num_rows, k).contiguous()
        return indices, indices < visible.unsqueeze(1)
    values, indices = scores.topk(k + 1, dim=1)
    indices = indices[:, :k].contiguous()
    tied = (values[:, k - 1] == values[:, k]) & (visible > k)
    capturing = scores.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing and bool(tied.any()):
        tied_rows = tied.nonzero().squeeze(1)
        tied_lengths = lengths[tied_rows]
        for length in torch.unique(tied_lengths).tolist():
            group = tied_rows[tied_lengths == length]
            indices[group] = scores[group, :length].topk(k, dim=1).indices
    indices = indices.sort(dim=1).values
    return indices, indices < visible.unsqueeze(1)


@indexer_topk_op.register_fake
def _(scores, lengths, visible, k):
    shape = (scores.shape[0], k)
    return scores.new_empty(shape, dtype=torch.long), scores.new_empty(shape, dtype=torch.bool)
