# SPDX-License-Identifier: Apache-2.0
"""Vocabulary-parallel token embedding and LM head, and a draft's hot-vocabulary head.

Each TP rank owns a contiguous slice of the (padded) vocabulary rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from runtime.distributed import ParallelGroup, all_gather_last_dim, all_reduce
from runtime.layers.narrow_weights import linear_product
from runtime.layers.weight_utils import copy_checked, make_param

_SINGLE = ParallelGroup()


def _padded(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: ParallelGroup = _SINGLE,
        params_dtype=None,
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        self.rows_per_rank = _padded(num_embeddings, tp.size) // tp.size
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = make_param(
            (self.rows_per_rank, embedding_dim), params_dtype, self.weight_loader
        )

    def weight_loader(self, param: torch.Tensor, loaded, shard_id=None) -> None:
        """Reads only this rank's rows of the `[vocab, dim]` table (lazy slices stay lazy)."""
        if loaded.shape[0] != self.num_embeddings or tuple(loaded.shape[1:]) != param.shape[1:]:
            raise ValueError(
                f"vocab table shape mismatch: expected ({self.num_embeddings}, "
                f"{self.embedding_dim}), got {tuple(loaded.shape)}"
            )
        count = max(0, min(self.rows_per_rank, self.num_embeddings - self.vocab_start))
        param.data.zero_()  # padding rows past the vocabulary
        if count:
            copy_checked(param.data[:count], loaded.narrow(0, self.vocab_start, count))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """`logits = hidden @ W^T` over the full vocabulary (shards gathered, padding trimmed)."""

    # captured steps may read a bf16 copy (narrow_weights.linear_product), products of many
    # rows its AMX tile layout where the CPU has AMX
    narrow_weight_names = ("weight",)
    tile_weight_names = ("weight",)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear_product(hidden, self)
        logits = all_gather_last_dim(logits, self.tp)
        return logits[..., : self.num_embeddings]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.compute_logits(hidden)


class HotVocabLMHead(nn.Module):
    """A draft's LM head over a fixed set of frequent tokens (FR-Spec, Zhao et al., 2025;
    SGLang's `--speculative-token-map`): the product reads `K` rows of the head instead of
    the whole vocabulary's, the bulk of a small draft step's weight traffic.

    The logits keep the full vocabulary's layout, so argmax, grammar masks and everything
    downstream stay as they are: every token outside the table scores the dtype's lowest
    finite value. A grammar that allows only such tokens still picks among them (a masked
    token scores -inf, below them). On a TP rank the table's ids in this rank's vocabulary
    slice fill its slice, and the slices are gathered as `ParallelLMHead` gathers them.
    """

    narrow_weight_names = ("weight",)
    tile_weight_names = ("weight",)

    def __init__(self, head: ParallelLMHead, hot_ids: Sequence[int]):
        super().__init__()
        self.num_embeddings, self.tp = head.num_embeddings, head.tp
        self.rows_per_rank = head.rows_per_rank
        local = torch.tensor(sorted(hot_ids), dtype=torch.long) - head.vocab_start
        local = local[(local >= 0) & (local < self.rows_per_rank)]
        # copies of the shared head's rows: the target keeps scoring the whole vocabulary
        self.register_buffer("weight", head.weight.detach()[local].clone(), persistent=False)
        self.register_buffer("local_rows", local.to(head.weight.device), persistent=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = linear_product(hidden, self)
        floor = torch.finfo(scores.dtype).min
        logits = scores.new_full((*scores.shape[:-1], self.rows_per_rank), floor)
        logits = logits.index_copy(-1, self.local_rows, scores)
        logits = all_gather_last_dim(logits, self.tp)
        return logits[..., : self.num_embeddings]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
