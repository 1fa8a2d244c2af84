# SPDX-License-Identifier: Apache-2.0
"""Next-token sampling for a batch whose requests each have their own parameters.

`target_probs` applies temperature, then top-k, top-p and min-p (SGLang's order) and
renormalises; speculative verification uses the same distribution. Sampling is an
exponential race `argmax(p / E)`, `E ~ Exp(1)`, whose uniforms come either from the
global generator or, for a request with `sampling_seed`, from a counter-based hash of
(seed, position, token id): the same seed and prompt give the same tokens in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _to_signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_MIX1 = _to_signed(0xBF58476D1CE4E5B9)
_MIX2 = _to_signed(0x94D049BB133111EB)
_GOLDEN = _to_signed(0x9E3779B97F4A7C15)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's `>>` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """Deterministic uniforms in (0, 1): `[R, width]` from per-row seed and position
    (splitmix64 finaliser over a counter; int64 arithmetic wraps)."""
    counter = (seeds.long() * _GOLDEN + positions.long() * _MIX2).unsqueeze(1)
    x = counter + torch.arange(width, device=seeds.device).unsqueeze(0) * _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    mantissa = _shift_right(x, 11).double()  # 53 random bits
    return ((mantissa + 0.5) / float(1 << 53)).float()


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors (one row per logits row)."""

    temperatures: torch.Tensor  # [R] (0 = greedy)
    top_ps: torch.Tensor  # [R]
    top_ks: torch.Tensor  # [R] (vocab size = off)
    min_ps: torch.Tensor  # [R]
    seeds: torch.Tensor  # [R] int64
    has_seed: torch.Tensor  # [R] bool

    @property
    def is_greedy(self) -> torch.Tensor:
        return self.temperatures == 0.0

    @property
    def all_greedy(self) -> bool:
        return bool(self.is_greedy.all())

    @classmethod
    def from_params(cls, params: Sequence, vocab_size: int, device="cpu") -> SamplingBatch:
        """`params`: objects with temperature / top_p / top_k / min_p / sampling_seed."""

        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.temperature == 0.0 or p.top_k == 1 for p in params]
        return cls(
            temperatures=col(
                [0.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32
            ),
            top_ps=col([p.top_p for p in params], torch.float32),
            top_ks=col(
                [vocab_size if p.top_k < 1 else min(p.top_k, vocab_size) for p in params],
                torch.long,
            ),
            min_ps=col([p.min_p for p in params], torch.float32),
            seeds=col([p.sampling_seed or 0 for p in params], torch.long),
            has_seed=col([p.sampling_seed is not None for p in params], torch.bool),
        )

    def select(self, rows: torch.Tensor) -> SamplingBatch:
        """The parameters repeated/picked for `rows` (e.g. every verify row of a request)."""
        return SamplingBatch(
            self.temperatures[rows],
            self.top_ps[rows],
            self.top_ks[rows],
            self.min_ps[rows],
            self.seeds[rows],
            self.has_seed[rows],
        )


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row samples from (greedy rows: one-hot on the argmax)."""
    logits = logits.float()
    temps = torch.where(batch.is_greedy, torch.ones_like(batch.temperatures), batch.temperatures)
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    drop = ranks >= batch.top_ks.unsqueeze(1)
    # top-p keeps the smallest prefix whose mass reaches p (the first token always stays)
    drop |= (sorted_probs.cumsum(-1) - sorted_probs) > batch.top_ps.unsqueeze(1)
    drop |= sorted_probs < (batch.min_ps * sorted_probs[:, 0]).unsqueeze(1)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    probs = probs / probs.sum(-1, keepdim=True)
    greedy = batch.is_greedy
    if greedy.any():
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), onehot, probs)
    return probs


def uniforms(
    batch: SamplingBatch,
    positions: torch.Tensor,
    width: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`[R, width]` uniforms: hashed for seeded rows, drawn from `generator` otherwise."""
    drawn = torch.rand((positions.shape[0], width), generator=generator, device=positions.device)
    if batch.has_seed.any():
        hashed = hashed_uniform(batch.seeds, positions, width)
        drawn = torch.where(batch.has_seed.unsqueeze(1), hashed, drawn)
    return drawn.clamp_(min=1e-20)


def sample_from_probs(
    probs: torch.Tensor,
    batch: SamplingBatch,
    positions: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row from `probs [R, V]` (exponential race)."""
    race = -torch.log(uniforms(batch, positions, probs.shape[-1], generator))
    return (probs / race).argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    positions: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`logits [R, V]` -> token ids `[R]`; `positions [R]` is each row's output position."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    ids = sample_from_probs(target_probs(logits, batch), batch, positions, generator)
    return torch.where(batch.is_greedy, logits.argmax(dim=-1), ids)
