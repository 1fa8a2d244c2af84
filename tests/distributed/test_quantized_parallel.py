# SPDX-License-Identifier: Apache-2.0
"""A quantized DeepSeek-V4 checkpoint (FP8-block projections, MXFP4 routed experts, kept
quantized) gives on two gloo ranks the logits one rank gives: codes and scales shard
together (rows of any size, columns along whole scale blocks / MXFP4 groups). The only
difference allowed is the order of floating-point sums."""

from __future__ import annotations

import pytest
import torch

from runtime.configs.parallel import ParallelLayout
from tests.distributed.harness import run_ranks
from tests.distributed.scenarios import nextn_forward_logits, nextn_forward_logits_on_rank
from tests.models.test_quantized_checkpoints import write_quantized
from tests.tiny_checkpoints import build_tiny_v4_mtp_checkpoint

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # block 4 and expert width 64: every rank's column share keeps whole blocks and groups
    source = build_tiny_v4_mtp_checkpoint(
        tmp_path_factory.mktemp("src"), seed=4, moe_intermediate_size=64
    )[0]
    return str(write_quantized(source, tmp_path_factory.mktemp("q"), "mxfp4", block=4))


def check_layout(path: str, tp: int, ep: int) -> None:
    want = nextn_forward_logits(None, path)
    (have,) = run_ranks(ParallelLayout(tp, ep), nextn_forward_logits_on_rank, [path])
    assert set(want) == set(have)
    for name in want:
        torch.testing.assert_close(have[name], want[name], **TOL, msg=name)


def test_quantized_tp2_equals_one_rank(checkpoint):
    """Projections split over TP, each routed expert's width split (MXFP4 groups whole)."""
    check_layout(checkpoint, 2, 1)


@pytest.mark.slow
def test_quantized_tp2_with_ep2_equals_one_rank(checkpoint):
    check_layout(checkpoint, 2, 2)
