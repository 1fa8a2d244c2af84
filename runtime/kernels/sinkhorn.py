# SPDX-License-Identifier: Apache-2.0
"""Sinkhorn normalisation of mHC mixing matrices (DeepSeek-V4).

`logits [..., n, n]` -> row softmax + eps, a column pass, then `iters - 1` row + column
passes, every denominator padded by eps (transformers' `DeepseekV4HyperConnection`).

The matrices are tiny (4 x 4) and the loop has ~80 elementwise steps, so the cost is
per-op dispatch. On CPU with few rows, numpy's per-op overhead is about half of torch's;
the numpy path runs the same operations in the same order (bit-identical results).
"""

from __future__ import annotations

import torch

_NUMPY_MAX_ROWS = 64


def sinkhorn_reference(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _sinkhorn_numpy(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = torch.softmax(logits, dim=-1).numpy() + eps
    comb /= comb.sum(-2, keepdims=True) + eps
    for _ in range(iters - 1):
        comb /= comb.sum(-1, keepdims=True) + eps
        comb /= comb.sum(-2, keepdims=True) + eps
    return torch.from_numpy(comb)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    rows = logits.numel() // (logits.shape[-1] * logits.shape[-2])
    if logits.device.type == "cpu" and rows <= _NUMPY_MAX_ROWS and not torch.is_grad_enabled():
        return _sinkhorn_numpy(logits.float(), iters, eps)
    return sinkhorn_reference(logits, iters, eps)
