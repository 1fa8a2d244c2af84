# SPDX-License-Identifier: Apache-2.0
"""What the parallel tests run on every rank (and once on a single process as the oracle):
the target and its MTP draft over a fixed batch, every kind of forward the NEXTN worker
issues, with fixed tokens so no rank's sampling is involved."""

from __future__ import annotations

import torch

from runtime.cache import PagedTokenAllocator, ReqToTokenPool, SlotTable
from runtime.configs.model_config import ModelConfig
from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
from runtime.distributed import Mapping
from runtime.engine.worker_factory import draft_class
from runtime.execution.model_input import ModelInput
from runtime.execution.model_runner import ModelRunner
from runtime.model_loader.build import load_model
from runtime.models.registry import resolve_model_class

PROMPTS = ([5, 9, 3, 17, 22, 8, 41, 7, 13, 2, 30, 11, 19, 6, 27, 33, 4, 15, 21, 9, 12], [3] * 26)
DRAFTS = [[7, 8, 9], [10, 11, 12]]
WIDTH = 4  # verify rows per request: the last token and three drafts


def nextn_forward_logits(mapping: Mapping | None, path: str) -> dict[str, torch.Tensor]:
    """Logits of: target prefill (every row), draft extend over it, target verify of three
    drafts, the draft's extend over the verified rows and one chained draft step."""
    mapping = mapping or Mapping.single()
    config = ModelConfig.from_path(path, "float32")
    table = SlotTable(ReqToTokenPool(4, 128), PagedTokenAllocator(64, 4))
    target_cls = resolve_model_class(config.architectures)
    runners = {}
    for name, cls in (("target", target_cls), ("draft", draft_class(target_cls, config))):
        model = load_model(config, cls, mapping, progress=False)
        runners[name] = ModelRunner(model, config, table, WIDTH)
    target, draft = runners["target"], runners["draft"]
    draft.model.set_embed_and_head(*target.model.get_embed_and_head())
    slots = [table.open_request() for _ in PROMPTS]
    for slot, prompt in zip(slots, PROMPTS):
        assert table.reserve(slot, len(prompt) + 2 * WIDTH)
    lens = [len(p) for p in PROMPTS]
    out: dict[str, torch.Tensor] = {}

    prefill = target.forward(
        ModelInput(
            ForwardMode.EXTEND,
            torch.tensor([t for p in PROMPTS for t in p]),
            slots,
            [0, 0],
            lens,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            logits_row_indices=None,
        )
    )
    out["target_prefill"] = prefill.next_token_logits
    following = [t for p, d in zip(PROMPTS, DRAFTS) for t in p[1:] + [d[0]]]
    extend = draft.forward(
        ModelInput(
            ForwardMode.DRAFT_EXTEND,
            torch.tensor(following),
            slots,
            [0, 0],
            lens,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            captured_hidden_states=prefill.hidden_states,
            logits_row_indices=None,
        )
    )
    out["draft_extend"] = extend.next_token_logits
    verify_ids = torch.tensor([[p[-1], *d] for p, d in zip(PROMPTS, DRAFTS)]).flatten()
    verify = target.forward(
        ModelInput(
            ForwardMode.TARGET_VERIFY,
            verify_ids,
            slots,
            [n - 1 for n in lens],
            [WIDTH, WIDTH],
            capture_hidden_mode=CaptureHiddenMode.FULL,
            logits_row_indices=None,
        )
    )
    out["target_verify"] = verify.next_token_logits
    target.kv_pool.commit_verified(torch.tensor(slots), torch.tensor([1, 2]))
    redraft = draft.forward(
        ModelInput(
            ForwardMode.DRAFT_EXTEND,
            torch.tensor([8, 9, 40, 2, 11, 12, 50, 3]),
            slots,
            [n - 1 for n in lens],
            [WIDTH, WIDTH],
            capture_hidden_mode=CaptureHiddenMode.LAST,
            captured_hidden_states=verify.hidden_states,
            logits_row_indices=[1, WIDTH + 2],
        )
    )
    out["draft_redraft"] = redraft.next_token_logits
    chain = draft.forward(
        ModelInput(
            ForwardMode.DECODE,
            redraft.next_token_logits.argmax(-1),
            slots,
            [lens[0] + 1, lens[1] + 2],
            [1, 1],
            capture_hidden_mode=CaptureHiddenMode.LAST,
            captured_hidden_states=redraft.hidden_states,
            spec_step_idx=1,
        )
    )
    out["draft_chain"] = chain.next_token_logits
    return out


def nextn_forward_logits_on_rank(replica, paths: list[str]) -> list[dict[str, torch.Tensor]]:
    return [nextn_forward_logits(replica.mapping, path) for path in paths]


def skewed_all_reduce_on_rank(replica, skew_s: float, configured_s: float) -> dict:
    """Rank 1 reaches an all-reduce `skew_s` after rank 0, whose data groups time out after
    `configured_s`: inside `patient_collectives` (a captured step compiling on every rank)
    rank 0 waits; after it, the configured timeout applies again."""
    import time
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from runtime.distributed import all_reduce
    from runtime.distributed import replica as replica_module

    configured = timedelta(seconds=configured_s)
    replica_module._DATA_GROUPS[:] = [(g, configured) for g, _ in replica_module._DATA_GROUPS]
    for group, _ in replica_module._DATA_GROUPS:
        distributed_c10d._set_pg_timeout(configured, group)
    group = replica.mapping.attn.tp
    with replica_module.patient_collectives():
        if replica.rank == 1:
            time.sleep(skew_s)
        patient = all_reduce(torch.ones(2), group).tolist()
    timed_out = None
    if replica.rank == 0:  # rank 1 never joins this one: the configured timeout is back
        try:
            dist.all_reduce(torch.ones(2), group=group.group)
            timed_out = False
        except RuntimeError:
            timed_out = True
    else:
        time.sleep(configured_s * 3)  # stay up until rank 0 has given up
    return {"patient": patient, "timed_out": timed_out}
