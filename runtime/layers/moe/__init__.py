# SPDX-License-Identifier: Apache-2.0
"""Mixture of experts: routing, fused expert weights, and the per-expert checkpoint loader."""

from runtime.layers.moe.checkpoint_loader import (
    ExpertCheckpointSchema,
    ExpertTarget,
    MoECheckpointLoader,
)
from runtime.layers.moe.experts import FusedMoEExperts
from runtime.layers.moe.router import select_experts

__all__ = [
    "ExpertCheckpointSchema",
    "ExpertTarget",
    "FusedMoEExperts",
    "MoECheckpointLoader",
    "select_experts",
]
