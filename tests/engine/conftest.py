# SPDX-License-Identifier: Apache-2.0
"""Fixtures the engine tests share."""

from __future__ import annotations

import pytest

from tests.tiny_checkpoints import build_tiny_qwen4_exp_mtp_checkpoint, build_tiny_v4_mtp_checkpoint


@pytest.fixture(scope="module", params=["deepseek_v4", "qwen4_exp"])
def checkpoint(request, tmp_path_factory):
    """A tiny checkpoint with an MTP layer of each family (seed 7), built once per module."""
    build = (
        build_tiny_v4_mtp_checkpoint
        if request.param == "deepseek_v4"
        else build_tiny_qwen4_exp_mtp_checkpoint
    )
    return build(tmp_path_factory.mktemp(request.param), seed=7)[0]
