# SPDX-License-Identifier: Apache-2.0
"""Fixtures the engine tests share."""

from __future__ import annotations

import pytest

from tests.tiny_checkpoints import build_tiny_qwen4_exp_mtp_checkpoint, build_tiny_v4_mtp_checkpoint

FAMILIES = ["deepseek_v4", "qwen4_exp"]


def build_mtp_checkpoint(family: str, path, seed: int = 7):
    """A tiny checkpoint of `family` with an MTP layer: (path, transformers target model,
    transformers model holding the MTP layer)."""
    build = (
        build_tiny_v4_mtp_checkpoint
        if family == "deepseek_v4"
        else build_tiny_qwen4_exp_mtp_checkpoint
    )
    return build(path, seed=seed)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """A tiny checkpoint with an MTP layer of each family (seed 7), built once per module."""
    return build_mtp_checkpoint(request.param, tmp_path_factory.mktemp(request.param))[0]
