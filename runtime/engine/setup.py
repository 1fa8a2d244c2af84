# SPDX-License-Identifier: Apache-2.0
"""What every rank of a replica derives identically from the `EngineConfig`: the model
config, the speculative shape and the request / token slot geometry. Rank 0's `Engine` and
the other ranks' processes both build from here, so their caches line up slot for slot."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from runtime.cache.allocator import PagedTokenAllocator
from runtime.cache.req_to_token_pool import ReqToTokenPool
from runtime.cache.slot_table import SlotTable
from runtime.configs.engine_config import EngineConfig
from runtime.configs.model_config import ModelConfig
from runtime.configs.speculative import SpeculativeConfig


@dataclass
class EngineSetup:
    model_config: ModelConfig
    spec_config: SpeculativeConfig | None
    slot_table: SlotTable
    snapshot_slots: int = 0  # per-request state snapshots each pool keeps (prefix cache)

    @property
    def pass_width(self) -> int:
        return self.spec_config.num_draft_tokens if self.spec_config else 1


def engine_setup(config: EngineConfig, device: str) -> EngineSetup:
    """`config` must be resolved."""
    spec = config.speculative_config()
    model_config = ModelConfig.from_path(
        config.model_path, config.dtype, config.context_length, device, config.quantization
    )
    pass_width = spec.num_draft_tokens if spec else 1
    table = build_slot_table(config, model_config.context_length, pass_width, device)
    snapshots = 0 if config.disable_radix_cache else config.radix_snapshot_slots
    return EngineSetup(model_config, spec, table, snapshots)


def with_resolved_dtype(config: EngineConfig) -> EngineConfig:
    """`config` with `--dtype auto` replaced by the dtype it resolves to here. On a CPU `auto`
    may time a short probe (`cpu_dtype`), which could pick differently on another rank; the
    ranks of a replica get the leader's choice instead (those this process starts)."""
    if config.dtype != "auto":
        return config
    dtype = ModelConfig.from_path(
        config.model_path, config.dtype, config.context_length, config.device
    ).dtype
    return dataclasses.replace(config, dtype=str(dtype).removeprefix("torch."))


def build_slot_table(
    config: EngineConfig, context_length: int, pass_width: int, device: str
) -> SlotTable:
    num_pages = config.max_total_tokens // config.page_size
    # room for the positions a speculative round writes past the context end
    max_context = min(context_length, num_pages * config.page_size) + 2 * pass_width
    max_context += config.page_size
    return SlotTable(
        ReqToTokenPool(config.max_running_requests, max_context, device),
        PagedTokenAllocator(num_pages, config.page_size, device),
    )
