# SPDX-License-Identifier: Apache-2.0
"""Sinkhorn normalisation of mHC mixing matrices (DeepSeek-V4).

`logits [..., n, n]` -> row softmax + eps, a column pass, then `iters - 1` row + column
passes, every denominator padded by eps (transformers' `DeepseekV4HyperConnection`).

The matrices are tiny (4 x 4) and the loop has ~80 elementwise steps, so the cost is
per-op dispatch; the paths differ only in how they dispatch. Few rows on CPU run through
numpy, many rows through torch with the matrices laid out matrix-last, and a captured step
through the torch reference (a single stream, `hc_mult = 1`, returns the constant result);
all of these are bit-identical to the reference. Eagerly with the project's C++ kernels
loaded, `nextn_cpu::sinkhorn` runs the same steps in one call; its exponential is the C
library's, so it agrees with the reference to within an ulp or so, not bit for bit.
Why each path exists: docs/architecture.md, "Module notes".
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.core.capture import in_capture
from runtime.kernels import cpu_extension

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


def _sinkhorn_rows_last(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn_reference` computed on `[n, n, rows]` (the softmax stays on the original
    layout: its kernel differs by layout)."""
    shape = logits.shape
    flat = logits.reshape(-1, shape[-2], shape[-1])
    comb = (torch.softmax(flat, dim=-1) + eps).permute(1, 2, 0).contiguous()
    comb.div_(comb.sum(dim=0, keepdim=True).add_(eps))
    for _ in range(iters - 1):
        comb.div_(comb.sum(dim=1, keepdim=True).add_(eps))
        comb.div_(comb.sum(dim=0, keepdim=True).add_(eps))
    return comb.permute(2, 0, 1).contiguous().view(shape)


def single_stream_value(iters: int, eps: float) -> float:
    """`sinkhorn_reference` of a 1 x 1 matrix, whatever its logit: the same fp32 steps on
    the host (softmax 1, plus eps, then `2 * iters - 1` passes of `c / (c + eps)`)."""
    eps32 = np.float32(eps)
    comb = np.float32(1) + eps32
    for _ in range(2 * iters - 1):
        comb = comb / (comb + eps32)
    return float(comb)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    if in_capture():
        if logits.shape[-1] == 1:
            value = single_stream_value(iters, eps)
            return torch.full_like(logits, value, dtype=torch.float32)
        return sinkhorn_reference(logits, iters, eps)
    if torch.is_grad_enabled():
        return sinkhorn_reference(logits, iters, eps)
    if logits.device.type == "cpu":
        if cpu_extension.available():
            return torch.ops.nextn_cpu.sinkhorn(logits.float(), iters, eps)
        if logits.numel() // (logits.shape[-1] * logits.shape[-2]) <= _NUMPY_MAX_ROWS:
            return _sinkhorn_numpy(logits.float(), iters, eps)
    return _sinkhorn_rows_last(logits, iters, eps)
