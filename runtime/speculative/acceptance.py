# SPDX-License-Identifier: Apache-2.0
"""Which draft tokens the target accepts.

Rows come per request as `[t_last, d1..dS]`; target row `j` scores the token after it.

* greedy: accept the longest prefix with `d_i == argmax(row i-1)`, then the bonus token
  `argmax(row m)` where `m` drafts were accepted.
* sampling (exact speculative sampling for a deterministic drafter): with `P_j` the
  request's filtered target distribution at row j, accept `d_i` with probability
  `P_{i-1}(d_i)`; at the first rejection sample from `P_{i-1}` with `d_i` removed
  (renormalised), else the bonus from `P_S`. Each emitted token is distributed exactly as
  plain sampling from `P` (Leviathan et al. 2023 with a one-hot draft distribution).
Greedy rows inside a sampling batch use one-hot `P`, which reduces to the greedy rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.execution.sampler import SamplingBatch, sample_from_probs, target_probs, uniforms

# Seeded requests draw their acceptance uniforms from a counter disjoint from token sampling.
_ACCEPT_STREAM = 1 << 40


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [bs] drafts accepted (0..S)
    final_tokens: torch.Tensor  # [bs] the bonus / replacement token after them

    def tokens(self, drafts: torch.Tensor) -> list[list[int]]:
        """Emitted tokens per request: accepted drafts then the final token."""
        out = []
        for row, m, last in zip(
            drafts.tolist(), self.num_accepted.tolist(), self.final_tokens.tolist()
        ):
            out.append(row[:m] + [last])
        return out


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> VerifyResult:
    """`logits [bs*N, V]`, `drafts [bs, S]`."""
    bs, steps = drafts.shape
    pred = logits.view(bs, steps + 1, -1).argmax(-1)
    num = (drafts == pred[:, :steps]).long().cumprod(dim=1).sum(dim=1)
    return VerifyResult(num, pred.gather(1, num.unsqueeze(1)).squeeze(1))


def verify_sampling(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    sampling: SamplingBatch,
    positions: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """`sampling`: one entry per request; `positions [bs]`: position of each request's first
    verify row (`t_last`), used to key seeded randomness."""
    bs, steps = drafts.shape
    rows = torch.arange(bs, device=drafts.device).repeat_interleave(steps + 1)
    probs = target_probs(logits, sampling.select(rows)).view(bs, steps + 1, -1)
    p_draft = probs[:, :steps].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = uniforms(sampling, positions + _ACCEPT_STREAM, steps, generator)
    num = (u <= p_draft).long().cumprod(dim=1).sum(dim=1)
    final_probs = probs[torch.arange(bs, device=probs.device), num]
    rejected = num < steps
    if rejected.any():
        rejected_token = drafts.gather(1, num.clamp(max=steps - 1).unsqueeze(1))
        removed = final_probs.scatter(1, rejected_token, 0.0)
        final_probs = torch.where(
            rejected.unsqueeze(1), removed / removed.sum(-1, keepdim=True), final_probs
        )
    final = sample_from_probs(final_probs, sampling, positions + num + 1, generator)
    return VerifyResult(num, final)


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    sampling: SamplingBatch,
    positions: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    if sampling.all_greedy:
        return verify_greedy(logits, drafts)
    return verify_sampling(logits, drafts, sampling, positions, generator)
