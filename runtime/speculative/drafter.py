# SPDX-License-Identifier: Apache-2.0
"""Chain drafting with the MTP layer (`topk = 1`), as SGLang's `eagle_worker.py` does for
NEXTN: one draft extend, then single-token steps.

The draft first runs over every row of a `DraftBatch` (filling its own KV), takes the
prediction at each request's gather row, then chains `num_steps - 1` single-token steps on
its own output hidden (`execution/draft_chain.py`: the one chain every round runs). Where
every request proposes and none has a grammar, the whole round (extend, argmax, chained
steps) runs as one captured graph when the draft's runner has one
(`ModelRunner.draft_round`, SGLang's EAGLE draft CUDA graph); otherwise, or while that
graph compiles, step by step. Drafting is greedy whatever the request's sampling parameters
(the acceptance rule keeps sampling exact); a request with a grammar drafts greedily among
the tokens its grammar allows (`DraftWalk`), so its drafts can be accepted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.core.model_output import LogitsProcessorOutput
from runtime.execution.draft_chain import draft_chain, greedy_pick
from runtime.execution.model_runner import TARGET, HiddenRows, ModelInput, ModelRunner
from runtime.speculative.draft_batch import DraftBatch


class MTPDrafter:
    def __init__(self, draft: ModelRunner, num_steps: int):
        self.runner, self.num_steps = draft, num_steps

    def draft(self, batch: DraftBatch) -> list[list[int] | None]:
        """`num_steps` draft tokens per request, or None where `batch.propose[b]` is False
        (a prefill chunk that only fills the draft's cache)."""
        batch = batch.drop_leading_rows(self._rows_to_skip(batch))
        keep = batch.proposing()
        if len(keep) == batch.batch_size and not batch.has_grammar(keep):
            drafts = self.runner.draft_round(
                self._extend_input(batch),
                [batch.first_chain_position(b) for b in keep],
                self.num_steps,
            )
            if drafts is not None:
                return drafts.tolist()
        out = self._extend(batch)
        result: list[list[int] | None] = [None] * batch.batch_size
        if not keep:
            return result
        walk = batch.grammar_walk(keep, self.runner.model_config.vocab_size)
        pick = walk.pick if walk is not None else greedy_pick
        try:
            logits, hidden = out.next_token_logits[keep], out.hidden_states[keep]
            proposals = self._chain(batch, keep, logits, hidden, pick)  # [k, S]
        finally:
            if walk is not None:
                walk.close()  # the grammars are back at the committed output
        for b, proposal in zip(keep, proposals.tolist()):
            result[b] = proposal
        return result

    def _rows_to_skip(self, batch: DraftBatch) -> list[int]:
        """Leading rows of each request the draft extend need not run: with a window-only
        draft (`kv_reach`), a row's KV depends on that row alone and later rows never read
        keys older than the window, so a long prompt only needs its last `reach` rows (and
        the gather row's window)."""
        reach = self.runner.model.kv_reach
        if reach is None:
            return [0] * batch.batch_size
        return [
            max(0, min(n - reach, g - reach + 1))
            for n, g in zip(batch.extend_lens, batch.gather_rows)
        ]

    def _extend(self, batch: DraftBatch) -> LogitsProcessorOutput:
        """The draft over every row; logits and hidden `[bs, ...]` at the gather rows."""
        return self.runner.forward(self._extend_input(batch))

    @staticmethod
    def _extend_input(batch: DraftBatch) -> ModelInput:
        return ModelInput(
            ForwardMode.DRAFT_EXTEND,
            batch.next_tokens,
            batch.req_pool_indices,
            batch.prefix_lens,
            batch.extend_lens,
            capture_hidden_mode=CaptureHiddenMode.LAST,
            captured_hidden_states=batch.target_hidden,
            logits_row_indices=batch.gather_indices(),
            hidden_rows=(
                HiddenRows(TARGET, batch.target_rows) if batch.from_latest_target else None
            ),
        )

    def _chain(
        self,
        batch: DraftBatch,
        keep: list[int],
        first_logits: torch.Tensor,
        first_hidden: torch.Tensor,
        pick: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The chain (`draft_chain`) of the requests `keep` from the extend's logits `[k, V]`
        and hidden `[k, D]` at their gather rows, each proposal chosen by `pick`: every
        draft token `[k, S]`."""
        pools = [batch.reqs[b].req_pool_idx for b in keep]
        first = [batch.first_chain_position(b) for b in keep]
        own = self.runner.role
        extend_rows = HiddenRows(own, torch.tensor(keep))  # the extend's proposing rows

        def step(i: int, tokens: torch.Tensor, hidden: torch.Tensor) -> LogitsProcessorOutput:
            return self.runner.forward(
                ModelInput(
                    ForwardMode.DECODE,
                    tokens,
                    pools,
                    [p + i - 1 for p in first],
                    [1] * len(keep),
                    capture_hidden_mode=CaptureHiddenMode.LAST,
                    captured_hidden_states=hidden,
                    spec_step_idx=i,
                    hidden_rows=extend_rows if i == 1 else HiddenRows(own),
                )
            )

        return draft_chain(first_logits, first_hidden, self.num_steps, step, pick)
