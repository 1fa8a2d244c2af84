# SPDX-License-Identifier: Apache-2.0
"""Chain drafting with the MTP layer (`topk = 1`).

Input per request: target rows at positions `prefix .. prefix + n - 1`, the token that
follows each row, and the target's captured hidden state of each row. The draft first
runs over all those rows (filling its own KV), takes the prediction at the row whose
successor is the newest committed token (`gather_row`), then chains `num_steps - 1`
single-token steps on its own output hidden. Drafting is greedy whatever the request's
sampling parameters (the acceptance rule keeps sampling exact).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.execution.model_runner import ModelInput, ModelRunner


class MTPDrafter:
    def __init__(self, draft: ModelRunner, num_steps: int):
        self.runner, self.num_steps = draft, num_steps

    def _rows_to_skip(self, extend_lens: list[int], gather_rows: list[int]) -> list[int]:
        """Leading rows of each request the draft extend need not run: with a window-only
        draft (`kv_reach`), a row's KV depends on that row alone and later rows never read
        keys older than the window, so a long prompt only needs its last `reach` rows (and
        the gather row's window)."""
        reach = getattr(self.runner.model, "kv_reach", None)
        if reach is None:
            return [0] * len(extend_lens)
        return [max(0, min(n - reach, g - reach + 1)) for n, g in zip(extend_lens, gather_rows)]

    def draft(
        self,
        reqs: Sequence,
        prefix_lens: list[int],
        extend_lens: list[int],
        next_tokens: torch.Tensor,
        target_hidden: torch.Tensor,
        gather_rows: Sequence[int],
        propose: Sequence[bool] | None = None,
    ) -> list[list[int] | None]:
        """Request b's rows sit at positions `prefix_lens[b] ..` (`extend_lens[b]` of them);
        `next_tokens [T]` is the token after each row, `target_hidden [T, D]` the target's
        captured state of each row, `gather_rows[b]` the row to draft from (its successor is
        the newest committed token). Returns `num_steps` draft tokens per request, or None
        where `propose[b]` is False (a prefill chunk that only fills the draft's cache)."""
        propose = [True] * len(reqs) if propose is None else list(propose)
        prefix_lens, extend_lens, gather_rows = (
            list(prefix_lens),
            list(extend_lens),
            list(gather_rows),
        )
        skip = self._rows_to_skip(extend_lens, gather_rows)
        if any(skip):
            starts = [0, *itertools.accumulate(extend_lens)][:-1]
            kept = torch.cat(
                [torch.arange(s + k, s + n) for s, k, n in zip(starts, skip, extend_lens)]
            )
            next_tokens, target_hidden = next_tokens[kept], target_hidden[kept]
            prefix_lens = [p + k for p, k in zip(prefix_lens, skip)]
            extend_lens = [n - k for n, k in zip(extend_lens, skip)]
            gather_rows = [g - k for g, k in zip(gather_rows, skip)]
        starts = torch.tensor(extend_lens).cumsum(0) - torch.tensor(extend_lens)
        rows = (starts + torch.tensor(gather_rows)).tolist()
        out = self.runner.forward(
            ModelInput(
                ForwardMode.DRAFT_EXTEND,
                next_tokens,
                [r.req_pool_idx for r in reqs],
                prefix_lens,
                extend_lens,
                capture_hidden_mode=CaptureHiddenMode.LAST,
                captured_hidden_states=target_hidden,
                logits_row_indices=rows,
            )
        )
        keep = [b for b, p in enumerate(propose) if p]
        if not keep:
            return [None] * len(reqs)
        tokens = out.next_token_logits[keep].argmax(-1)
        hidden = out.hidden_states[keep]
        pools = [reqs[b].req_pool_idx for b in keep]
        positions = [prefix_lens[b] + gather_rows[b] + 1 for b in keep]
        drafts = [tokens]
        for step in range(1, self.num_steps):
            out = self.runner.forward(
                ModelInput(
                    ForwardMode.DECODE,
                    tokens,
                    pools,
                    positions,
                    [1] * len(keep),
                    capture_hidden_mode=CaptureHiddenMode.LAST,
                    captured_hidden_states=hidden,
                    spec_step_idx=step,
                )
            )
            tokens, hidden = out.next_token_logits.argmax(-1), out.hidden_states
            drafts.append(tokens)
            positions = [p + 1 for p in positions]
        proposals = torch.stack(drafts, dim=1).tolist()
        result: list[list[int] | None] = [None] * len(reqs)
        for b, proposal in zip(keep, proposals):
            result[b] = proposal
        return result
