# SPDX-License-Identifier: Apache-2.0
"""`NextNWorker`: one NEXTN round per decode step (DESIGN.md section 3).

    extend:  target prefill (capture hidden) -> sample t -> draft extend -> drafts d1..dS
    decode:  target verify [t, d1..dS] -> accept m drafts + one token -> draft extend over
             the verified rows -> next drafts

Caches need no explicit rollback: every cache row is keyed by position, verify and draft
only write positions at or after the committed length, and the next round rewrites the
rejected positions before anything reads them (rings are sized for one extra pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.configs.speculative import SpeculativeConfig
from runtime.execution.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.execution.model_runner import ModelInput, ModelRunner
from runtime.execution.sampler import SamplingBatch
from runtime.execution.worker import extend_input, sample_next
from runtime.speculative.acceptance import verify


@dataclass
class SpecStats:
    """Engine-wide acceptance counters."""

    num_steps: int
    verify_rounds: int = 0
    emitted_tokens: int = 0  # accepted drafts + the final token, per round
    accepted_at: list[int] = field(default_factory=list)  # [i]: rounds that accepted draft i+1

    def __post_init__(self):
        self.accepted_at = [0] * self.num_steps

    def record(self, num_accepted: Sequence[int]) -> None:
        for m in num_accepted:
            self.verify_rounds += 1
            self.emitted_tokens += m + 1
            for i in range(m):
                self.accepted_at[i] += 1

    @property
    def avg_accept_length(self) -> float:
        return self.emitted_tokens / self.verify_rounds if self.verify_rounds else 0.0

    def acceptance_rate_per_position(self) -> list[float]:
        return [a / self.verify_rounds if self.verify_rounds else 0.0 for a in self.accepted_at]


class NextNWorker:
    def __init__(self, target: ModelRunner, drafter, spec: SpeculativeConfig,
                 generator: torch.Generator | None = None):
        self.target, self.drafter, self.spec, self.generator = target, drafter, spec, generator
        self.vocab_size = target.model_config.vocab_size
        self.stats = SpecStats(spec.num_steps)

    def reserve_ahead(self) -> int:
        """Verify writes up to `seq_len - 1 + S`, draft steps up to `seq_len + 2S - 2`."""
        return 2 * self.spec.num_steps

    def extend(self, reqs: Sequence) -> list[list[int]]:
        inp = extend_input(reqs, CaptureHiddenMode.FULL)
        out = self.target.forward(inp)
        first = sample_next(reqs, out.next_token_logits, self.vocab_size, self.generator)
        # draft row at position p reads the token at p + 1; the last row reads the new token
        shifted = [t for r, f in zip(reqs, first) for t in r.all_ids[r.num_cached + 1:] + [f]]
        drafts = self.drafter.draft(reqs, inp.prefix_lens, inp.extend_lens,
                                    torch.tensor(shifted, dtype=torch.long), out.hidden_states,
                                    [n - 1 for n in inp.extend_lens])
        for r, d in zip(reqs, drafts):
            r.draft_tokens = d
        return [[f] for f in first]

    def decode(self, reqs: Sequence) -> list[list[int]]:
        steps = self.spec.num_steps
        width = steps + 1
        drafts = torch.tensor([r.draft_tokens for r in reqs], dtype=torch.long)
        committed = [r.num_cached for r in reqs]
        last = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long)
        ids = torch.cat([last.unsqueeze(1), drafts], dim=1).flatten()  # [t_last, d1..dS] per request
        pools = [r.req_pool_idx for r in reqs]
        out = self.target.forward(ModelInput(
            ForwardMode.TARGET_VERIFY, ids, pools, committed, [width] * len(reqs),
            capture_hidden_mode=CaptureHiddenMode.FULL, logits_row_indices=None))
        sampling = SamplingBatch.from_params([r.sampling_params for r in reqs], self.vocab_size)
        result = verify(out.next_token_logits, drafts, sampling, torch.tensor(committed), self.generator)
        num_accepted = result.num_accepted.tolist()
        self.stats.record(num_accepted)

        # verify row j is followed by d_{j+1} (accepted rows) or the final token (row m)
        following = torch.cat([drafts, result.final_tokens.unsqueeze(1)], dim=1)
        following[torch.arange(len(reqs)), result.num_accepted] = result.final_tokens
        new_drafts = self.drafter.draft(reqs, committed, [width] * len(reqs), following.flatten(),
                                        out.hidden_states, num_accepted)
        for r, d, m in zip(reqs, new_drafts, num_accepted):
            r.draft_tokens = d
            r.spec_verify_ct += 1
            if not r.spec_accept_hist:
                r.spec_accept_hist = [0] * width
            r.spec_accept_hist[m] += 1
        return result.tokens(drafts)
