# SPDX-License-Identifier: Apache-2.0
"""Write a benchmark prompt file (JSONL, `{"prompt": ...}` per line) from the Python files the
embedded default model never trained on: the held-out part of the interpreter's standard
library, split exactly as `train_tiny_model.py` splits it.

Random token ids are the SGLang default dataset, but a draft model cannot guess noise: on
random prompts NEXTN acceptance says little about real use. These prompts are in the
default model's domain without being in its training data.

    python scripts/make_code_prompts.py --num-prompts 64 --prompt-chars 1200 -o prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train_tiny_model import split_by_file, stdlib_sources


def code_prompts(num_prompts: int, prompt_chars: int, holdout_every: int) -> list[str]:
    """The opening `prompt_chars` characters (cut back to a line end) of `num_prompts` evenly
    spaced held-out files long enough to fill them."""
    _, held = split_by_file(stdlib_sources(), holdout_every)
    usable = [text for _, text in held if len(text) > prompt_chars]
    if len(usable) < num_prompts:
        raise ValueError(
            f"only {len(usable)} held-out files have more than {prompt_chars} characters; "
            "lower --num-prompts or --prompt-chars"
        )
    picked = usable[:: len(usable) // num_prompts][:num_prompts]
    prompts = []
    for text in picked:
        cut = text.rfind("\n", prompt_chars // 2, prompt_chars)
        prompts.append(text[: cut + 1] if cut >= 0 else text[:prompt_chars])
    return prompts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-chars", type=int, default=1200)
    p.add_argument("--holdout-every", type=int, default=20, help="as train_tiny_model.py")
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
