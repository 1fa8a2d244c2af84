# SPDX-License-Identifier: Apache-2.0
"""Write a draft hot-vocabulary table for `--speculative-token-map`: the `--num-tokens` most
frequent token ids of a corpus under the model's tokenizer, plus its end-of-sequence ids.

FR-Spec (Zhao et al., 2025) ranks tokens by their frequency in a corpus and lets the draft's
LM head score only the top of that ranking; SGLang reads such a table with
`--speculative-token-map`. Count over text like what the server will see (the model's
training data where it is known): a draft can only propose what the table holds, so a table
from the wrong domain lowers acceptance (never correctness: the target verifies every token).

    # the embedded default model: the standard-library files it trained on (not the held-out
    # files that scripts.make_code_prompts draws benchmark prompts from)
    python -m scripts.make_token_map --stdlib-train --num-tokens 2048 -o freq_2048.json
    # any model: JSONL records (text / prompt / completion / messages) or plain-text files
    python -m scripts.make_token_map --model-path DIR --dataset-path corpus.jsonl docs/ \\
        --num-tokens 32768 -o freq_32768.pt

The table is a JSON list when the output ends in `.json`, else a `torch.save`d list of ids
(the format FR-Spec publishes and SGLang loads).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from scripts.bench.flags import new_parser
from training.hot_vocab import hot_tokens, write_table

TEXT_FIELDS = ("text", "prompt", "completion", "content")


def main(argv: list[str] | None = None) -> None:
    p = new_parser("scripts.make_token_map", __doc__)
    p.add_argument("--model-path", default=None, help="checkpoint (default: the embedded model)")
    p.add_argument(
        "--dataset-path",
        nargs="+",
        default=[],
        help="JSONL files (records with text, prompt, completion or messages), other files "
        "as plain text, directories recursively",
    )
    p.add_argument(
        "--stdlib-train",
        action="store_true",
        help="count over the training split of the interpreter's standard library, the "
        "embedded default model's training data (split as training/train_tiny_model.py does)",
    )
    p.add_argument("--num-tokens", type=int, required=True, help="table size before EOS ids")
    p.add_argument("-o", "--output", required=True, help="*.json, or anything else for torch.save")
    args = p.parse_args(argv)
    try:
        if args.num_tokens < 1:
            raise ValueError("--num-tokens must be >= 1")
        if not args.dataset_path and not args.stdlib_train:
            raise ValueError("give --dataset-path, --stdlib-train or both")
        texts = list(corpus_texts(args.dataset_path, args.stdlib_train))
        if not texts:
            raise ValueError("the corpus holds no text")
    except (ValueError, OSError) as err:
        print(f"make_token_map: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    tokenizer, eos_ids = tokenizer_and_eos(args.model_path)
    counts = count_tokens(tokenizer, texts)
    table = hot_tokens(counts, args.num_tokens, eos_ids)
    write_table(table, Path(args.output))
    covered = sum(counts[t] for t in table) / max(1, sum(counts.values()))
    print(
        f"wrote {len(table)} token ids to {args.output}: they cover {covered:.1%} of the "
        f"corpus's {sum(counts.values())} tokens ({len(texts)} texts)"
    )


def corpus_texts(paths: list[str], stdlib_train: bool) -> Iterator[str]:
    if stdlib_train:
        from training.corpus import (
            DEFAULT_HOLDOUT_EVERY,
            split_by_file,
            stdlib_sources,
        )

        train, _ = split_by_file(stdlib_sources(), DEFAULT_HOLDOUT_EVERY)
        yield from (text for _, text in train)
    for path in map(Path, paths):
        if not path.exists():
            raise ValueError(f"--dataset-path '{path}' does not exist")
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        for file in files:
            yield from file_texts(file)


def file_texts(file: Path) -> Iterator[str]:
    text = file.read_text(encoding="utf-8", errors="replace")
    if file.suffix != ".jsonl":
        yield text
        return
    for line in text.splitlines():
        if line.strip():
            yield from record_texts(json.loads(line))


def record_texts(record) -> Iterator[str]:
    """Every text field of a JSONL record, chat messages included."""
    if isinstance(record, str):
        yield record
        return
    for name in TEXT_FIELDS:
        if isinstance(record.get(name), str):
            yield record[name]
    for message in record.get("messages") or record.get("conversations") or []:
        if isinstance(message, dict):
            yield from record_texts(message)


def tokenizer_and_eos(model_path: str | None):
    from transformers import AutoConfig

    from runtime.configs.engine_config import default_model_path
    from runtime.engine.tokenizer import load_tokenizer

    path = model_path or default_model_path()
    eos = getattr(AutoConfig.from_pretrained(path), "eos_token_id", None)
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return load_tokenizer(path, required=True), eos_ids


def count_tokens(tokenizer, texts: list[str]) -> Counter:
    counts: Counter = Counter()
    batch = 256
    for start in range(0, len(texts), batch):
        encoded = tokenizer(texts[start : start + batch], add_special_tokens=False, verbose=False)
        for ids in encoded["input_ids"]:
            counts.update(ids)
    return counts


if __name__ == "__main__":
    main()
