# SPDX-License-Identifier: Apache-2.0
"""Self-distillation of a trained checkpoint's MTP draft, the trunk frozen
(`python -m training.distill_draft`).

Joint training teaches the MTP one thing: the token after next from the trunk's streams.
Served with `--speculative-num-steps 3`, the draft also runs chained: its second and third
steps read its own output streams, which it never saw in training, and the embedding of
its own proposal. Only proposals equal to the target's choice are accepted, so the draft's
job is to predict the trunk, not the corpus. This stage trains exactly that, after HASS
(Zhang et al., "Learning Harmonized Representations for Speculative Sampling") and EAGLE-3's
training-time test: every pass of the chain runs over all rows at once
(`TinyModel.chained_draft`), and each pass's logits are pulled towards the frozen trunk's
distribution at the same position by KL divergence (Medusa-2 and EAGLE distill from the
target's distribution rather than the data's labels):

    loss = mean over passes k of KL(trunk(. | t_<=r+1) || draft_k(. | row r)),  rows r >= k

The trunk's weights do not change, so the checkpoint's outputs do not either; only the
acceptance of its drafts does."""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from training.loop import TrainState, budget_left, start_step


def distill_loss(trunk_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Mean over passes of the per-row KL from the trunk's next-token distribution at row
    r+1 to pass k's draft distribution at row r (rows r >= k: earlier ones have no chain)."""
    passes, seq = draft_logits.shape[1:3]
    teacher = F.log_softmax(trunk_logits[:, 1 : seq + 1].float(), dim=-1)
    total = draft_logits.new_zeros((), dtype=torch.float32)
    for k in range(passes):
        student = F.log_softmax(draft_logits[:, k, k:].float(), dim=-1)
        total = total + F.kl_div(
            student.flatten(0, 1),
            teacher[:, k:].flatten(0, 1),
            log_target=True,
            reduction="batchmean",
        )
    return total / passes


@torch.no_grad()
def chain_agreement(model: nn.Module, windows: torch.Tensor, batch: int, passes: int) -> list:
    """Per pass, the share of rows whose draft argmax equals the trunk's argmax at the same
    position (the greedy acceptance test of that draft step, on teacher-forced text)."""
    model.eval()
    hits, rows = [0.0] * passes, [0] * passes
    for i in range(0, len(windows), batch):
        trunk_logits, draft_logits = model.chained_draft(windows[i : i + batch], passes)
        seq = draft_logits.shape[2]
        target = trunk_logits[:, 1 : seq + 1].argmax(-1)
        for k in range(passes):
            same = draft_logits[:, k, k:].argmax(-1) == target[:, k:]
            hits[k] += same.sum().item()
            rows[k] += same.numel()
    model.train()
    return [h / n for h, n in zip(hits, rows)]


def freeze_trunk_(model: nn.Module) -> list[nn.Parameter]:
    """Freeze everything but the MTP layer; returns the MTP's parameters. The embedding and
    head are the trunk's (shared), so they stay frozen too."""
    for param in model.parameters():
        param.requires_grad_(False)
    params = list(model.mtp.parameters())
    for param in params:
        param.requires_grad_(True)
    return params


def distill(args, model: nn.Module, train_stream: torch.Tensor) -> TrainState:
    """The loop: AdamW on the MTP's parameters, the trainer's warm-up + cosine schedule and
    its --max-steps / --max-minutes budgets."""
    from tqdm import tqdm

    params = freeze_trunk_(model)
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    state = TrainState()
    model.train()
    bar = tqdm(
        total=args.max_steps or None,
        mininterval=2 if sys.stderr.isatty() else 30,
        desc="distill",
    )
    while budget_left(args, state):
        started = time.perf_counter()
        lr, tokens = start_step(args, state, optimizer, train_stream, gen)
        loss = distill_loss(*model.chained_draft(tokens, args.num_steps))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        optimizer.step()
        state.step += 1
        state.tokens += args.batch_size * args.seq_len
        state.elapsed += time.perf_counter() - started
        bar.update(1)
        bar.set_postfix(
            kl=f"{loss.item():.3f}", lr=f"{lr:.1e}", min=f"{state.elapsed / 60:.1f}", refresh=False
        )
    bar.close()
    return state
