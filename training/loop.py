# SPDX-License-Identifier: Apache-2.0
"""The training loop: losses of the trunk (next token) and the MTP (token after next),
AdamW with a warm-up + cosine schedule bounded by a step and a time budget, held-out
evaluation, and a resumable training state.

Loss = CE(trunk, t_{i+1}) + mtp_weight * CE(MTP, t_{i+2}) (+ the family's router balancing
term)."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from training.families import FAMILIES

STATE_FILE = "train_state.pt"


@dataclass
class TrainState:
    step: int = 0
    elapsed: float = 0.0  # training seconds so far, across resumes
    tokens: int = 0


def sample_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `seq + 2` tokens (inputs, next and after-next targets)."""
    starts = torch.randint(0, len(stream) - seq - 2, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq + 2] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor, count: int, seq: int) -> torch.Tensor:
    """`count` evenly spaced windows of the held-out stream (the same every time)."""
    count = max(1, min(count, (len(stream) - 1) // (seq + 2)))
    starts = torch.linspace(0, len(stream) - seq - 2, count).long()
    return torch.stack([stream[s : s + seq + 2] for s in starts.tolist()])


def losses(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Cross-entropies of the trunk (t_{i+1}) and the MTP (t_{i+2}), plus top-1 agreement
    of the MTP with the trunk's next prediction (what greedy NEXTN accepts as draft 1)."""
    seq = tokens.shape[1] - 2
    trunk_logits, mtp_logits = model(tokens)
    targets = tokens.long()
    trunk = F.cross_entropy(trunk_logits.flatten(0, 1).float(), targets[:, 1 : seq + 1].flatten())
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), targets[:, 2:].flatten())
    with torch.no_grad():
        trunk_pred, mtp_pred = trunk_logits.argmax(-1), mtp_logits.argmax(-1)
        agree = (mtp_pred[:, :-1] == trunk_pred[:, 1:]).float().mean()
        trunk_acc = (trunk_pred == targets[:, 1 : seq + 1]).float().mean()
        mtp_acc = (mtp_pred == targets[:, 2:]).float().mean()
    return {
        "trunk": trunk,
        "mtp": mtp,
        "trunk_acc": trunk_acc,
        "mtp_acc": mtp_acc,
        "mtp_agreement": agree,
    }


@torch.no_grad()
def evaluate_heldout(model: nn.Module, windows: torch.Tensor, batch: int, autocast: bool) -> dict:
    """Mean held-out losses / accuracies over fixed windows."""
    model.eval()
    totals: dict[str, float] = {}
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            result = losses(model, chunk)
        for k, v in result.items():
            totals[k] = totals.get(k, 0.0) + v.item() * len(chunk)
    model.train()
    return {k: v / len(windows) for k, v in totals.items()}


def make_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms, biases, mHC mixers, sinks)."""
    decay, rest = [], []
    for name, param in model.named_parameters():
        plain_matrix = param.ndim >= 2 and "hc" not in name
        (decay if plain_matrix else rest).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def learning_rate(args, state: TrainState) -> float:
    """Linear warm-up, then cosine to `min_lr_ratio * lr`; progress is whichever of the step
    and time budgets is further along, so the schedule ends when training does."""
    if state.step < args.warmup_steps:
        return args.lr * (state.step + 1) / args.warmup_steps
    progress = 0.0
    if args.max_steps:
        progress = max(progress, state.step / args.max_steps)
    if args.max_minutes:
        progress = max(progress, state.elapsed / (60 * args.max_minutes))
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def budget_left(args, state: TrainState) -> bool:
    if args.max_steps and state.step >= args.max_steps:
        return False
    return not (args.max_minutes and state.elapsed >= 60 * args.max_minutes)


def start_step(args, state: TrainState, optimizer, stream: torch.Tensor, gen) -> tuple:
    """Set the schedule's learning rate on every parameter group and draw the step's batch;
    returns `(lr, tokens)`."""
    lr = learning_rate(args, state)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr, sample_batch(stream, args.batch_size, args.seq_len, gen)


def save_state(path: Path, model, optimizer, state: TrainState, gen, config) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "state": vars(state),
            "data_rng": gen.get_state(),
            "config": config,
        },
        tmp,
    )
    os.replace(tmp, path)  # never leave a half-written state behind


def train(args, model: nn.Module, train_stream, held_windows, work_dir: Path) -> TrainState:
    """The training loop: stops at --max-steps / --max-minutes, saving its state as it goes."""
    from tqdm import tqdm

    optimizer = make_optimizer(model, args)
    balancer = FAMILIES[args.family].make_balancer(model, args)
    gen = torch.Generator().manual_seed(args.seed + 2)
    state, state_path = TrainState(), work_dir / STATE_FILE
    if args.resume and state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        gen.set_state(saved["data_rng"])
        state = TrainState(**saved["state"])
        print(f"resumed from {state_path} at step {state.step}", flush=True)
    model.train()
    interactive = sys.stderr.isatty()
    bar = tqdm(
        total=args.max_steps or None,
        initial=state.step,
        dynamic_ncols=interactive,
        mininterval=2 if interactive else 30,
        desc="train",
    )
    last_save = last_eval = state.elapsed
    while budget_left(args, state):
        started = time.perf_counter()
        lr, tokens = start_step(args, state, optimizer, train_stream, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            result = losses(model, tokens)
        loss = result["trunk"] + args.mtp_weight * result["mtp"]
        balance = balancer.loss()  # None where routers balance without a loss term
        if balance is not None:
            loss = loss + balance
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        balancer.update()
        state.step += 1
        state.tokens += tokens.numel() - 2 * len(tokens)
        state.elapsed += time.perf_counter() - started
        bar.update(1)
        bar.set_postfix(
            loss=f"{result['trunk'].item():.3f}",
            mtp=f"{result['mtp'].item():.3f}",
            agree=f"{result['mtp_agreement'].item():.2f}",
            lr=f"{lr:.1e}",
            min=f"{state.elapsed / 60:.1f}",
            refresh=False,
        )
        if state.elapsed - last_eval >= 60 * args.eval_every_minutes:
            last_eval = state.elapsed
            held = evaluate_heldout(model, held_windows, args.batch_size, args.precision == "bf16")
            bar.write(
                f"step {state.step} ({state.elapsed / 60:.1f} min): held-out "
                + format_metrics(held)
            )
        if state.elapsed - last_save >= 60 * args.save_every_minutes:
            last_save = state.elapsed
            save_state(state_path, model, optimizer, state, gen, model.config)
    bar.close()
    save_state(state_path, model, optimizer, state, gen, model.config)
    return state


def format_metrics(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


def warn_if_slow_precision(precision: str) -> None:
    """bf16 matmuls have fast CPU kernels only with AVX512 (BF16/AMX); on an AVX2 CPU torch
    falls back to a scalar GEMM, measured ~10x slower per training step than fp32."""
    capability = torch.backends.cpu.get_cpu_capability()
    if precision == "bf16" and not capability.startswith("AVX512"):
        print(
            f"warning: this CPU's best vector ISA is {capability}, where bf16 matmuls are about "
            "10x slower than fp32; pass --precision fp32 (the default model was trained with "
            "bf16 autocast on an AVX512 CPU)",
            file=sys.stderr,
            flush=True,
        )
