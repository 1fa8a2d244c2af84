# SPDX-License-Identifier: Apache-2.0
"""Sampling: filters against a direct computation, seeded reproducibility, and a
chi-square test that samples follow the target distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from runtime.core.errors import InvalidRequestError
from runtime.core.sampling_params import SamplingParams
from runtime.execution.sampler import SamplingBatch, hashed_uniform, sample, target_probs


def batch_of(*params: dict, vocab=6) -> SamplingBatch:
    return SamplingBatch.from_params([SamplingParams.from_dict(p) for p in params], vocab)


def test_greedy_is_argmax():
    logits = torch.randn(4, 6)
    out = sample(logits, batch_of(*[{"temperature": 0}] * 4), torch.arange(4))
    assert torch.equal(out, logits.argmax(-1))


def test_filters_match_direct_computation():
    logits = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]] * 3))
    probs = target_probs(logits, batch_of({"top_k": 2}, {"top_p": 0.75}, {"min_p": 0.3}))
    expected = torch.tensor(
        [[0.4, 0.25, 0, 0, 0, 0], [0.4, 0.25, 0.15, 0, 0, 0], [0.4, 0.25, 0.15, 0, 0, 0]]
    )
    torch.testing.assert_close(probs, expected / expected.sum(-1, keepdim=True))
    hot = target_probs(logits[:1], batch_of({"temperature": 0.5}))
    torch.testing.assert_close(hot, torch.softmax(logits[:1] / 0.5, -1))


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = torch.randn(1, 50)
    seeded = {"temperature": 1.0, "sampling_seed": 1234}
    alone = [
        sample(logits, batch_of(seeded, vocab=50), torch.tensor([p])).item() for p in range(20)
    ]
    mixed = []
    for p in range(20):
        two = sample(
            torch.cat([torch.randn(1, 50), logits]),
            batch_of({"temperature": 1.0}, seeded, vocab=50),
            torch.tensor([p, p]),
        )
        mixed.append(two[1].item())
    assert alone == mixed
    other = [
        sample(
            logits, batch_of({"temperature": 1.0, "sampling_seed": 99}, vocab=50), torch.tensor([p])
        ).item()
        for p in range(20)
    ]
    assert other != alone


def test_hashed_uniforms_look_uniform():
    u = hashed_uniform(torch.full((200,), 7), torch.arange(200), 50).flatten()
    assert 0 < u.min() and u.max() < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert chisquare(counts.numpy()).pvalue > 1e-3


@pytest.mark.parametrize(
    "params",
    [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.8}, {"temperature": 1.3, "top_k": 3}],
)
def test_samples_follow_the_target_distribution(params):
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.5, 0.2, -0.3, -1.0, 0.0]]).repeat(20000, 1)
    batch = batch_of(*[params] * logits.shape[0])
    ids = sample(logits, batch, torch.zeros(logits.shape[0], dtype=torch.long))
    probs = target_probs(logits[:1], batch_of(params))[0]
    support = probs > 0
    observed = torch.bincount(ids, minlength=6).float()
    assert observed[~support].sum() == 0
    expected = probs[support] * logits.shape[0]
    assert chisquare(observed[support].numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": "x"}, "max_new_tokens"),
        ({"bogus": 1}, "unknown sampling parameter"),
    ],
)
def test_bad_sampling_params_are_rejected(bad, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams.from_dict(bad)
