# SPDX-License-Identifier: Apache-2.0
"""Train a tiny model with one MTP (NextN) layer on CPU: the embedded default DeepSeek-V4,
or a Qwen4Exp (`--family qwen4_exp`).

The corpus is the Python standard library of the running interpreter (offline everywhere),
split by file into train and held-out parts. The trainer fits a byte-level BPE tokenizer,
then the family's trunk (transformers' modules, training mode, no cache) together with one
MTP layer whose math is exactly the runtime's draft. This file is only the command line;
`training` holds the stages (corpus, families, loop, export, evaluation,
model_card).

Loss = CE(trunk, t_{i+1}) + mtp_weight * CE(MTP, t_{i+2}) (+ the family's router balancing
term). The output directory is a released-naming checkpoint (bf16 safetensors, `mtp.*`
included), config.json, the tokenizer and a README model card with held-out losses and the
runtime's measured NEXTN acceptance and speed.

    python -m training.train_tiny_model --max-minutes 60           # train, export, evaluate
    python -m training.train_tiny_model --resume --max-minutes 90  # continue from --work-dir
    python -m training.train_tiny_model --evaluate-only runtime/assets/deepseek_v4_tiny
    python -m training.train_tiny_model --family qwen4_exp --output-dir /ckpt/qwen4_exp_tiny
"""

from __future__ import annotations

import os

# Threads that wait at OpenMP barriers must sleep, not spin: with 2 threads on 2 shared
# cores, a spinning thread starves its partner whenever another process runs, and steps
# become 5-50x slower. Set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from training.corpus import (  # noqa: E402
    DEFAULT_HOLDOUT_EVERY,
    TOKEN_IDS,
    prepare_corpus,
)
from training.evaluation import (  # noqa: E402
    add_evaluation_arguments,
    evaluate_checkpoint,
)
from training.export import (  # noqa: E402
    count_parameters,
    export_checkpoint,
    export_hot_vocab,
    training_summary,
)
from training.families import FAMILIES  # noqa: E402
from training.loop import (  # noqa: E402
    STATE_FILE,
    eval_windows,
    train,
    warn_if_slow_precision,
)

PROG = "training.train_tiny_model"


def _family_flag(parser) -> None:
    parser.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        default="deepseek_v4",
        help="model family; the shape flags and defaults shown are this family's "
        "(`--family NAME --help` for another)",
    )


def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    _family_flag(pre)
    family = FAMILIES[pre.parse_known_args(argv)[0].family]
    p = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = p.add_argument_group("run")
    _family_flag(run)
    run.add_argument("--output-dir", default=str(family.DEFAULT_OUTPUT))
    run.add_argument(
        "--work-dir",
        default=str(family.DEFAULT_WORK_DIR),
        help="training state and tokenizer, for --resume",
    )
    run.add_argument("--resume", action="store_true", help="continue from --work-dir's state")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--max-minutes", type=float, default=60.0, help="training-loop time budget (0: none)"
    )
    run.add_argument("--max-steps", type=int, default=0, help="step budget (0: none)")
    run.add_argument("--threads", type=int, default=2)
    run.add_argument("--save-every-minutes", type=float, default=10.0)
    run.add_argument("--eval-every-minutes", type=float, default=10.0)
    data = p.add_argument_group("corpus")
    data.add_argument(
        "--corpus-limit-files",
        type=int,
        default=0,
        help="train on an evenly spaced slice of this many files (0: all)",
    )
    data.add_argument("--holdout-every", type=int, default=DEFAULT_HOLDOUT_EVERY)
    data.add_argument("--vocab-size", type=int, default=4096)
    family.add_arguments(p)
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--seq-len", type=int, default=256)
    opt.add_argument("--batch-size", type=int, default=8)
    opt.add_argument("--lr", type=float, default=2e-3)
    opt.add_argument("--min-lr-ratio", type=float, default=0.1)
    opt.add_argument("--warmup-steps", type=int, default=100)
    opt.add_argument("--weight-decay", type=float, default=0.1)
    opt.add_argument("--grad-clip", type=float, default=1.0)
    opt.add_argument("--mtp-weight", type=float, default=0.5)
    opt.add_argument(
        "--mtp-detach",
        action="store_true",
        help="no MTP gradient into the trunk (the MTP reads detached streams)",
    )
    opt.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default="bf16",
        help="bf16 autocast measured ~15%% faster than fp32 on a 2-core AVX512 CPU, about 10x "
        "slower on an AVX2-only one (a warning says so)",
    )
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--evaluate-only", metavar="DIR", help="only evaluate a checkpoint directory")
    add_evaluation_arguments(ev)
    ev.add_argument("--spec-steps", type=int, default=3)
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv=None) -> dict:
    """Train, export and evaluate (or only evaluate); returns the evaluation figures."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.evaluate_only:
        return evaluate_checkpoint(Path(args.evaluate_only), args)
    warn_if_slow_precision(args.precision)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    corpus = prepare_corpus(
        work_dir, args.corpus_limit_files, args.holdout_every, args.vocab_size, args.resume
    )
    print("corpus: " + json.dumps(corpus.info), flush=True)
    family = FAMILIES[args.family]
    config = family.model_config(args, corpus.tokenizer.get_vocab_size(), TOKEN_IDS)
    state_path = work_dir / STATE_FILE
    if args.resume and state_path.exists():
        config = torch.load(state_path, weights_only=False)["config"]  # the shape trained so far
    model = family.TinyModel(config, args.seed)
    model.detach_streams = args.mtp_detach
    print("parameters: " + json.dumps(count_parameters(model)), flush=True)
    held_windows = eval_windows(corpus.held_stream, max(1, args.eval_windows // 4), args.seq_len)
    state = train(args, model, corpus.train_stream, held_windows, work_dir)
    output = Path(args.output_dir)
    summary = training_summary(args, state, model, corpus)
    summary["size_mb"] = export_checkpoint(model, corpus.tokenizer, output)
    export_hot_vocab(corpus, output)
    (output / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"wrote {output} ({summary['size_mb']:.1f} MB) after {state.step} steps, "
        f"{state.elapsed / 60:.1f} min",
        flush=True,
    )
    return evaluate_checkpoint(output, args)


if __name__ == "__main__":
    main()
