# SPDX-License-Identifier: Apache-2.0
"""`NextNWorker`: NEXTN speculative decoding (DESIGN.md section 3).

    prefill chunk: target extend (capture hidden) -> [sample t] -> draft extend -> [d1..dS]
    decode round:  target verify [t, d1..dS] -> accept m drafts + one token -> draft extend
                   over the verified rows -> next drafts

Caches need no explicit rollback: every cache row is keyed by position, verify and draft
only write positions at or after the committed length, and the next round rewrites the
rejected positions before anything reads them (rings are sized for one extra pass).
Prefill chunks and verify rounds run in separate steps (`supports_mixed = False`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.configs.speculative import SpeculativeConfig
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.core.step_io import Chunk, TokenOutput
from runtime.execution.model_runner import ModelInput, ModelRunner
from runtime.execution.penalties import RowHistory, adjust_logits
from runtime.execution.sampler import SamplingBatch
from runtime.execution.worker import LogitRows, chunk_input, chunk_outputs, token_logprob_outputs
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
    supports_mixed = False

    def __init__(
        self,
        target: ModelRunner,
        drafter,
        spec: SpeculativeConfig,
        eos_ids: set[int],
        generator: torch.Generator | None = None,
    ):
        self.target, self.drafter, self.spec = target, drafter, spec
        self.eos_ids, self.generator = eos_ids, generator
        self.vocab_size = target.model_config.vocab_size
        self.stats = SpecStats(spec.num_steps)

    def reserve_ahead(self) -> int:
        """Verify writes up to `seq_len - 1 + S`, draft steps up to `seq_len + 2S - 2`."""
        return 2 * self.spec.num_steps

    def step(
        self, prefill: Sequence[Chunk], decode: Sequence
    ) -> tuple[list[TokenOutput], list[TokenOutput]]:
        if prefill and decode:
            raise ValueError("NEXTN runs prefill chunks and verify rounds in separate steps")
        return (self._prefill(prefill), []) if prefill else ([], self._verify(decode))

    def _prefill(self, chunks: Sequence[Chunk]) -> list[TokenOutput]:
        inp = chunk_input(chunks, ForwardMode.EXTEND, CaptureHiddenMode.FULL)
        rows = LogitRows(chunks)
        inp.logits_row_indices = rows.rows
        out = self.target.forward(inp)
        outputs = chunk_outputs(
            chunks, rows, out.next_token_logits, self.vocab_size, self.eos_ids, self.generator
        )
        # draft row at position p reads the token at p + 1 (the new token after the prompt)
        following = [
            t
            for c, o in zip(chunks, outputs)
            for t in c.req.all_ids[c.start + 1 : c.end] + (o.tokens or [c.req.all_ids[c.end]])
        ]
        drafts = self.drafter.draft(
            [c.req for c in chunks],
            inp.prefix_lens,
            inp.extend_lens,
            torch.tensor(following, dtype=torch.long),
            out.hidden_states,
            [c.length - 1 for c in chunks],
            [c.completes for c in chunks],
        )
        for c, d in zip(chunks, drafts):
            if d is not None:
                c.req.draft_tokens = d
        return outputs

    def _verify(self, reqs: Sequence) -> list[TokenOutput]:
        steps = self.spec.num_steps
        width = steps + 1
        drafts = torch.tensor([r.draft_tokens for r in reqs], dtype=torch.long)
        committed = [r.num_cached for r in reqs]
        last = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long)
        ids = torch.cat(
            [last.unsqueeze(1), drafts], dim=1
        ).flatten()  # [t_last, d1..dS] per request
        out = self.target.forward(
            ModelInput(
                ForwardMode.TARGET_VERIFY,
                ids,
                [r.req_pool_idx for r in reqs],
                committed,
                [width] * len(reqs),
                capture_hidden_mode=CaptureHiddenMode.FULL,
                logits_row_indices=None,
            )
        )
        # row j of request b sees the history plain decoding would have there: drafts d1..dj
        histories = [
            RowHistory(r, tuple(d[:j])) for r, d in zip(reqs, drafts.tolist()) for j in range(width)
        ]
        logits = adjust_logits(out.next_token_logits, histories, self.eos_ids)
        sampling = SamplingBatch.from_params([r.sampling_params for r in reqs], self.vocab_size)
        result = verify(logits, drafts, sampling, torch.tensor(committed), self.generator)
        num_accepted = result.num_accepted.tolist()
        self.stats.record(num_accepted)
        # recurrent caches keep the state after the last accepted row
        self.target.kv_pool.commit_verified(
            torch.tensor([r.req_pool_idx for r in reqs]), result.num_accepted
        )

        # verify row j is followed by d_{j+1} (accepted rows) or the final token (row m)
        following = torch.cat([drafts, result.final_tokens.unsqueeze(1)], dim=1)
        following[torch.arange(len(reqs)), result.num_accepted] = result.final_tokens
        new_drafts = self.drafter.draft(
            reqs,
            committed,
            [width] * len(reqs),
            following.flatten(),
            out.hidden_states,
            num_accepted,
        )
        tokens = result.tokens(drafts)
        logprobs = token_logprob_outputs(
            reqs, out.next_token_logits, tokens, [b * width for b in range(len(reqs))]
        )
        outputs = []
        for r, d, m, toks, lp in zip(reqs, new_drafts, num_accepted, tokens, logprobs):
            r.draft_tokens = d
            r.spec_verify_ct += 1
            if not r.spec_accept_hist:
                r.spec_accept_hist = [0] * width
            r.spec_accept_hist[m] += 1
            outputs.append(TokenOutput(toks, *(lp if lp is not None else (None, None))))
        return outputs
