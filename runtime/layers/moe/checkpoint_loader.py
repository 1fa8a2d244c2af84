# SPDX-License-Identifier: Apache-2.0
"""Maps per-expert checkpoint tensors (`...experts.{E}.w1.weight`) into fused parameters.

Released MoE checkpoints store every expert as separate matrices; the runtime keeps one
stacked tensor per projection. The schema names which checkpoint projection is gate, up
and down. Experts outside this rank's expert-parallel block are marked non-local and
skipped by the caller.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertCheckpointSchema:
    gate_proj_name: str = "gate_proj"
    down_proj_name: str = "down_proj"
    up_proj_name: str = "up_proj"

    def fused_target(self, proj: str) -> tuple[str, str]:
        """Checkpoint projection name -> (fused parameter name, shard id)."""
        if proj == self.gate_proj_name:
            return "w13_weight", "w1"
        if proj == self.up_proj_name:
            return "w13_weight", "w3"
        if proj == self.down_proj_name:
            return "w2_weight", "w2"
        raise KeyError(proj)


@dataclass(frozen=True)
class ExpertTarget:
    param: str  # fused parameter name, e.g. `model.layers.3.ffn.experts.w13_weight`
    shard_id: str  # "w1", "w3" or "w2"
    expert_id: int  # global expert id
    local: bool  # held by this expert-parallel rank


class MoECheckpointLoader:
    def __init__(
        self, schema: ExpertCheckpointSchema, num_experts: int, ep_rank: int = 0, ep_size: int = 1
    ):
        self.schema = schema
        self.per_rank = num_experts // ep_size
        self.first_local = ep_rank * self.per_rank
        projections = "|".join(
            re.escape(p)
            for p in (schema.gate_proj_name, schema.up_proj_name, schema.down_proj_name)
        )
        self._pattern = re.compile(
            rf"^(?P<prefix>.*)\.experts\.(?P<expert>\d+)\.(?P<proj>{projections})\.weight$"
        )

    def map(self, name: str) -> ExpertTarget | None:
        """The fused target of a per-expert tensor name; None for any other name."""
        match = self._pattern.match(name)
        if match is None:
            return None
        suffix, shard_id = self.schema.fused_target(match["proj"])
        expert = int(match["expert"])
        local = self.first_local <= expert < self.first_local + self.per_rank
        return ExpertTarget(f"{match['prefix']}.experts.{suffix}", shard_id, expert, local)
