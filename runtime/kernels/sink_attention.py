# SPDX-License-Identifier: Apache-2.0
"""Attention over a per-row gathered key set, with a learned per-head sink.

`q [T, H, D]`, `kv [T, K, D]` (keys and values are the same latent, as in DeepSeek-V4's
single-latent MQA), `valid [T, K]`, `sink [H]`. For each row and head:
    z_i = scale * q . k_i                      (invalid i masked out)
    o   = sum_i exp(z_i - m) k_i / (sum_i exp(z_i - m) + exp(sink - m))
The sink only adds to the denominator. Softmax statistics are fp32.
"""

from __future__ import annotations

import torch


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
