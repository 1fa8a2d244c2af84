# SPDX-License-Identifier: Apache-2.0
"""`PlainWorker`: one target forward per step, one sampled token per request.

Workers sit between the scheduler (requests, token ids) and the model runners (tensors).
Each step returns the new tokens of every request; the scheduler applies finish checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.execution.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.execution.model_runner import ModelInput, ModelRunner
from runtime.execution.sampler import SamplingBatch, sample
from runtime.layers.logits_processor import LogitsProcessorOutput


def extend_input(reqs: Sequence, capture: CaptureHiddenMode = CaptureHiddenMode.NULL) -> ModelInput:
    """Every request's uncached tokens (`all_ids[num_cached:]`) on top of its cached prefix."""
    tokens = [r.all_ids[r.num_cached:] for r in reqs]
    return ModelInput(
        ForwardMode.EXTEND,
        input_ids=torch.tensor([t for seq in tokens for t in seq], dtype=torch.long),
        req_pool_indices=[r.req_pool_idx for r in reqs],
        prefix_lens=[r.num_cached for r in reqs],
        extend_lens=[len(t) for t in tokens],
        capture_hidden_mode=capture)


def sample_next(reqs: Sequence, logits: torch.Tensor, vocab_size: int,
                generator: torch.Generator | None) -> list[int]:
    """One token per request from its logits row; seeded rows are keyed by output position."""
    batch = SamplingBatch.from_params([r.sampling_params for r in reqs], vocab_size)
    positions = torch.tensor([r.seq_len for r in reqs], dtype=torch.long)
    return sample(logits, batch, positions, generator).tolist()


class PlainWorker:
    def __init__(self, target: ModelRunner, generator: torch.Generator | None = None):
        self.target, self.generator = target, generator
        self.vocab_size = target.model_config.vocab_size

    def reserve_ahead(self) -> int:
        """Positions past `seq_len` a step may write (none: decode writes `seq_len - 1`)."""
        return 0

    def extend(self, reqs: Sequence) -> list[list[int]]:
        out: LogitsProcessorOutput = self.target.forward(extend_input(reqs))
        return [[t] for t in sample_next(reqs, out.next_token_logits, self.vocab_size, self.generator)]

    def decode(self, reqs: Sequence) -> list[list[int]]:
        inp = ModelInput(
            ForwardMode.DECODE,
            input_ids=torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.long),
            req_pool_indices=[r.req_pool_idx for r in reqs],
            prefix_lens=[r.num_cached for r in reqs],
            extend_lens=[1] * len(reqs))
        logits = self.target.forward(inp).next_token_logits
        return [[t] for t in sample_next(reqs, logits, self.vocab_size, self.generator)]
