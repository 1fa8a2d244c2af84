# SPDX-License-Identifier: Apache-2.0
"""Distill a tiny checkpoint's MTP draft from its own frozen trunk, trained as the runtime
chains it (`training/draft_distill.py` has the method and its sources). The
trunk's weights, and so the model's output, stay as they were; the drafts' acceptance
rises. Writes the checkpoint (default: in place), then re-evaluates it as the trainer does
(held-out figures, the runtime's NEXTN acceptance and speed, the model card).

    python -m training.distill_draft --max-minutes 40     # the embedded default model
    python -m training.distill_draft --model-path DIR --output-dir OUT --max-steps 200
"""

from __future__ import annotations

import os

# As in the trainer: waiting OpenMP threads sleep instead of spinning on shared cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from training.corpus import checkpoint_corpus, encode_documents  # noqa: E402
from training.draft_distill import chain_agreement, distill  # noqa: E402
from training.evaluation import (  # noqa: E402
    add_evaluation_arguments,
    evaluate_checkpoint,
)
from training.export import DISTILLER_MODULE, export_checkpoint, load_checkpoint  # noqa: E402
from training.families import deepseek_v4  # noqa: E402

PROG = DISTILLER_MODULE


def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = p.add_argument_group("run")
    run.add_argument("--model-path", default=str(deepseek_v4.DEFAULT_OUTPUT))
    run.add_argument("--output-dir", help="where to write the checkpoint (default: in place)")
    run.add_argument("--max-minutes", type=float, default=30.0, help="time budget (0: none)")
    run.add_argument("--max-steps", type=int, default=0, help="step budget (0: none)")
    run.add_argument("--threads", type=int, default=2)
    run.add_argument("--seed", type=int, default=0)
    opt = p.add_argument_group("optimisation")
    opt.add_argument(
        "--num-steps", type=int, default=3, help="draft steps chained in training (and served)"
    )
    opt.add_argument("--seq-len", type=int, default=256)
    opt.add_argument("--batch-size", type=int, default=8)
    opt.add_argument("--lr", type=float, default=5e-4)
    opt.add_argument("--min-lr-ratio", type=float, default=0.1)
    opt.add_argument("--warmup-steps", type=int, default=20)
    opt.add_argument("--grad-clip", type=float, default=1.0)
    ev = p.add_argument_group("evaluation (as the trainer's)")
    add_evaluation_arguments(ev)
    args = p.parse_args(argv)
    if args.num_steps < 1:
        p.error("--num-steps must be at least 1")
    args.spec_steps = args.num_steps  # the runtime evaluation speculates as it was trained
    args.argv = argv
    return args


def main(argv=None) -> dict:
    from training.loop import eval_windows

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    source = Path(args.model_path)
    output = Path(args.output_dir or source)
    summary = json.loads((source / "training.json").read_text())
    model = load_checkpoint(source)
    if not hasattr(model, "chained_draft"):
        print(
            f"{PROG}: error: {model.config['model_type']} has no chained training form "
            "(its MTP block does not attend through a mask)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    tokenizer, train_sources, held_sources = checkpoint_corpus(source, summary["corpus"])
    train_stream = encode_documents(tokenizer, [text for _, text in train_sources])
    held_stream = encode_documents(tokenizer, [text for _, text in held_sources])
    held = eval_windows(held_stream, max(1, args.eval_windows // 4), args.seq_len)
    before = chain_agreement(model, held, args.batch_size, args.num_steps)
    print(f"held-out chain agreement before: {before}", flush=True)
    state = distill(args, model, train_stream)
    after = chain_agreement(model, held, args.batch_size, args.num_steps)
    print(f"held-out chain agreement after {state.step} steps: {after}", flush=True)
    if output != source:
        shutil.copytree(source, output, dirs_exist_ok=True)  # the hot vocabulary and the rest
    summary["size_mb"] = export_checkpoint(model, tokenizer, output)
    if "draft_distillation" in summary:  # a further round on a distilled draft: keep the record
        earlier = summary.get("earlier_draft_distillations", [])
        summary["earlier_draft_distillations"] = [*earlier, summary["draft_distillation"]]
    summary["draft_distillation"] = {
        "command": " ".join(["-m", PROG, *args.argv]),
        "steps": state.step,
        "minutes": state.elapsed / 60,
        "tokens": state.tokens,
        "threads": args.threads,
        "num_steps": args.num_steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "min_lr_ratio": args.min_lr_ratio,
        "seed": args.seed,
        "heldout_windows": len(held),
        "agreement_before": before,
        "agreement_after": after,
    }
    (output / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return evaluate_checkpoint(output, args)


if __name__ == "__main__":
    main()
