# SPDX-License-Identifier: Apache-2.0
"""Two gloo ranks on the CPU give the logits one rank gives, in fp32, for both families and
both MTP drafts: target prefill, draft extend, target verify, the draft's extend over the
verified rows and a chained draft step (every forward the NEXTN worker issues). The only
difference allowed is the order of floating-point sums (partial products reduced across
ranks)."""

from __future__ import annotations

import pytest
import torch

from runtime.configs.parallel import ParallelLayout
from tests.distributed.harness import run_ranks
from tests.distributed.scenarios import (
    nextn_forward_logits,
    nextn_forward_logits_on_rank,
    skewed_all_reduce_on_rank,
)
from tests.tiny_checkpoints import build_tiny_qwen4_exp_mtp_checkpoint, build_tiny_v4_mtp_checkpoint

# fp32 sums in another order: observed <= 4e-6 on logits of magnitude ~3
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    v4 = build_tiny_v4_mtp_checkpoint(tmp_path_factory.mktemp("v4_tp"), seed=3)[0]
    qwen = build_tiny_qwen4_exp_mtp_checkpoint(tmp_path_factory.mktemp("qwen_tp"), seed=3)[0]
    return [str(v4), str(qwen)]


def check_layout(checkpoints, tp: int, ep: int) -> None:
    expected = [nextn_forward_logits(None, path) for path in checkpoints]
    got = run_ranks(ParallelLayout(tp, ep), nextn_forward_logits_on_rank, checkpoints)
    for path, want, have in zip(checkpoints, expected, got):
        assert set(want) == set(have)
        for name in want:
            assert have[name].shape == want[name].shape
            torch.testing.assert_close(have[name], want[name], **TOL, msg=f"{path} {name}")


def test_tp2_with_ep2_equals_one_rank(checkpoints):
    """Attention heads, vocabulary and shared experts over TP, routed experts over EP."""
    check_layout(checkpoints, 2, 2)


@pytest.mark.slow
def test_tp2_equals_one_rank(checkpoints):
    """Experts split by width (moe tp 2) instead of by expert."""
    check_layout(checkpoints, 2, 1)


@pytest.mark.slow
def test_ep2_equals_one_rank(checkpoints):
    """Attention replicated on both ranks, routed experts in two blocks."""
    check_layout(checkpoints, 1, 2)


def test_collectives_wait_for_a_rank_still_compiling():
    """`patient_collectives`: while the ranks of a replica compile a captured step (one may
    finish long before the other), collectives outlast `--dist-timeout`; after it, the
    configured timeout bounds a collective again."""
    got = run_ranks(ParallelLayout(2, 1), skewed_all_reduce_on_rank, 3.0, 1.0)
    assert got == {"patient": [2.0, 2.0], "timed_out": True}
