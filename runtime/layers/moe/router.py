# SPDX-License-Identifier: Apache-2.0
"""Top-k expert selection.

scores = score_fn(router_logits); the selection ranks `scores + correction_bias` (the bias
steers load balance and never weighs an output), or is fixed by a hash table of token ids;
the selected scores are renormalised to sum to one and scaled by `routed_scaling_factor`.
One operator where `runtime.kernels.moe_route` serves, else its torch reference.
"""

from __future__ import annotations

import torch

from runtime.kernels import moe_route as route_kernel
from runtime.kernels.moe_route import score_experts

__all__ = ["score_experts", "select_experts"]


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
    args = (
        router_logits,
        correction_bias,
        hash_expert_ids,
        top_k,
        scoring_func,
        renormalize,
        routed_scaling_factor,
    )
    if route_kernel.uses_kernel(router_logits, scoring_func):
        return route_kernel.moe_route(*args)
    return route_kernel.moe_route_reference(*args)
