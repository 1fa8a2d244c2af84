# SPDX-License-Identifier: Apache-2.0
"""Write a benchmark prompt file (JSONL, `{"prompt": ...}` per line) from the Python files the
embedded default model never trained on: the held-out part of the interpreter's standard
library, split exactly as the tiny-model trainer splits it.

Random token ids are the SGLang default dataset, but a draft model cannot guess noise: on
random prompts NEXTN acceptance says little about real use. These prompts are in the
default model's domain without being in its training data.

    python -m scripts.make_code_prompts --num-prompts 64 --prompt-chars 1200 -o prompts.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scripts.bench.datasets import code_prompts
from scripts.bench.flags import new_parser
from training.corpus import DEFAULT_HOLDOUT_EVERY


def main(argv: list[str] | None = None) -> None:
    p = new_parser("scripts.make_code_prompts", __doc__)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-chars", type=int, default=1200)
    p.add_argument(
        "--holdout-every",
        type=int,
        default=DEFAULT_HOLDOUT_EVERY,
        help="as the trainer's --holdout-every",
    )
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    try:
        prompts = code_prompts(args.num_prompts, args.prompt_chars, args.holdout_every)
    except ValueError as err:
        print(f"make_code_prompts: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    lines = [json.dumps({"prompt": prompt}) for prompt in prompts]
    Path(args.output).write_text("\n".join(lines) + "\n")
    print(f"wrote {len(prompts)} prompts to {args.output}")


if __name__ == "__main__":
    main()
