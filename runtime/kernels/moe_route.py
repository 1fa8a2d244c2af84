# SPDX-License-Identifier: Apache-2.0
"""The MoE router's expert selection as one operator:

    scores = score_fn(logits);  ids = top_k(scores + bias)  (or a hash table's ids)
    weights = scores[ids] / sum(scores[ids]) * routed_scaling_factor

`logits [T, E]` -> `(weights [T, k] fp32, ids [T, k] int64)`. The torch form is about ten
operators per MoE layer of a captured step. On CPU `nextn_cpu::moe_route`
(`csrc/moe_route.cpp`) is the reference's body as the same ATen calls (like
`nextn_cpu::indexer_topk`): one node, called without Python, with the eager values bit for
bit. On CUDA the custom op `nextn::moe_route` holds the reference as one node too (its
top-k keeps torch's kernel: the order of the selected ids orders the experts' sum). The
reference defines correctness.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.kernels import cpu_extension

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def score_experts(router_logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = router_logits.float()
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    raise ValueError(
        f"unsupported MoE scoring_func {scoring_func!r}; supported: {', '.join(SCORING_FUNCS)}"
    )


def moe_route_reference(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
    top_k: int,
    scoring_func: str,
    renormalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection in plain torch (the test oracle)."""
    scores = score_experts(logits, scoring_func)
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        ranked = scores if bias is None else scores + bias.float()
        ids = torch.topk(ranked, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def uses_kernel(logits: torch.Tensor, scoring_func: str) -> bool:
    """Whether `moe_route` is one operator for these logits, eagerly and in captured steps:
    `[T, E]`, a known scoring function, no grad wanted, on CPU with the C++ kernels loaded
    or on CUDA."""
    if logits.dim() != 2 or scoring_func not in SCORING_FUNCS or torch.is_grad_enabled():
        return False
    if logits.device.type == "cpu":
        return cpu_extension.serves(logits)
    return logits.device.type == "cuda"


def moe_route(logits, bias, hash_ids, top_k, scoring_func, renormalize, scale):
    """The selection as one operator (callers check `uses_kernel` first)."""
    args = (logits, bias, hash_ids, top_k, scoring_func, renormalize, float(scale))
    if logits.device.type == "cpu":
        return torch.ops.nextn_cpu.moe_route(*args)
    return moe_route_op(*args)


@torch.library.custom_op("nextn::moe_route", mutates_args=())
def moe_route_op(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
    top_k: int,
    scoring_func: str,
    renormalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = moe_route_reference(
        logits, bias, hash_ids, top_k, scoring_func, renormalize, scale
    )
    # never the hash table's ids themselves (an op's output may not alias its input)
    return weights.contiguous(), ids.clone(memory_format=torch.contiguous_format)


@moe_route_op.register_fake
def _(logits, bias, hash_ids, top_k, scoring_func, renormalize, scale):
    return route_fake(logits, hash_ids, top_k)


def route_fake(logits, hash_ids, top_k):
    """The outputs' shapes: `[T, k]` (k the hash table's width where ids come from it)."""
    k = top_k if hash_ids is None else hash_ids.shape[1]
    shape = (logits.shape[0], k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.long)
