# SPDX-License-Identifier: Apache-2.0
"""Top-k expert selection.

scores = score_fn(router_logits); the selection ranks `scores + correction_bias` (the bias
steers load balance and never weighs an output), or is fixed by a hash table of token ids;
the selected scores are renormalised to sum to one and scaled by `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def score_experts(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = router_logits.float()
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    raise ValueError(
        f"unsupported MoE scoring_func {scoring_func!r}; supported: sqrtsoftplus, sigmoid, softmax"
    )


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str,
    correction_bias: torch.Tensor | None = None,
    hash_expert_ids: torch.Tensor | None = None,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`router_logits [T, E]` -> `(weights [T, k] fp32, expert_ids [T, k] int64)`.

    `hash_expert_ids [T, k]` (from `tid2eid[input_ids]`) replaces the learned selection.
    """
    scores = score_experts(router_logits, scoring_func)
    if hash_expert_ids is not None:
        ids = hash_expert_ids.long()
    else:
        ranked = scores if correction_bias is None else scores + correction_bias.float()
        ids = torch.topk(ranked, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
