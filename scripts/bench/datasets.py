# SPDX-License-Identifier: Apache-2.0
"""Every prompt source of the benchmarks, seeded so that each variant of a run (and the HF
baseline) sees the same prompts:

- SGLang's random dataset: lengths uniform in `[len * range_ratio, len]`, prompts as random
  token ids (in-process and native `/generate`) or text decoded from random ids (OpenAI);
- a prompt file: JSONL objects with "prompt" (optional "output_len"), or one prompt a line;
- a static batch for `bench_one_batch`: random ids, or file prompts cut to one length;
- multi-turn chats (`bench_serving`): a system prompt every conversation shares, then per
  turn a user message; turn k+1 resends turns 1..k with the server's answers;
- code prompts: the openings of the Python files the embedded default model held out.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runtime.engine.tokenizer import load_tokenizer

WARMUP_OUTPUT_LEN = 8  # tokens of a static batch's warm-up run, outside every timing
WARMUP_PROMPTS, WARMUP_PROMPT_OUTPUT_LEN = 4, 4  # a dataset's warm-up run


@dataclass
class BenchRequest:
    """One request of a dataset: text or token ids, and how long its output is."""

    prompt: str | None
    input_ids: list[int] | None
    prompt_len: int  # client-side count (0 when unknown); a server's own count replaces it
    output_len: int


# --------------------------------------------------------------------------------------
# building blocks


def random_token_ids(rng: random.Random, length: int, vocab_size: int, low: int = 0) -> list[int]:
    """`length` ids drawn uniformly from [low, vocab_size)."""
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def random_lengths(rng: random.Random, count: int, full: int, range_ratio: float) -> list[int]:
    """SGLang's random dataset lengths: uniform in [max(1, full * ratio), full]."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    low = max(int(full * range_ratio), 1)
    return [rng.randint(low, max(full, low)) for _ in range(count)]


def random_texts(rng: random.Random, tokenizer, lengths: list[int]) -> list[str]:
    """Texts decoded from random non-special token ids (SGLang's random dataset); the server
    reports how many tokens each becomes."""
    special = set(tokenizer.all_special_ids)
    usable = [i for i in range(len(tokenizer)) if i not in special]
    return [
        tokenizer.decode([usable[rng.randrange(len(usable))] for _ in range(n)]) for n in lengths
    ]


def read_prompt_file(path: str | Path) -> list[dict]:
    """Prompts from a file: JSONL objects with "prompt" (or "text"; optional "output_len"),
    else one prompt per non-empty line."""
    records = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = None
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {err}") from None
            prompt = record.get("prompt", record.get("text"))
            if not isinstance(prompt, str):
                raise ValueError(f'{path}:{lineno}: a JSONL record needs a string "prompt"')
            out_len = record.get("output_len")
            records.append({"prompt": prompt, "output_len": int(out_len) if out_len else None})
        else:
            records.append({"prompt": line, "output_len": None})
    if not records:
        raise ValueError(f"{path} holds no prompts")
    return records


def model_vocab_size(model_path: str | None, tokenizer) -> int:
    """The vocabulary random ids are drawn from: config.json of the checkpoint (when it is on
    this machine), else the tokenizer's size."""
    if model_path and (Path(model_path) / "config.json").is_file():
        config = json.loads((Path(model_path) / "config.json").read_text())
        size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        if size:
            return int(size)
    if tokenizer is not None:
        return len(tokenizer)
    raise ValueError(
        "cannot tell the model's vocabulary size: the server's model path is not "
        "readable here; pass --tokenizer"
    )


# --------------------------------------------------------------------------------------
# request lists (bench_offline_throughput, bench_serving)


def random_requests(
    seed: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    *,
    vocab_size: int | None = None,
    tokenizer=None,
) -> list[BenchRequest]:
    """SGLang's random dataset: token ids drawn from `vocab_size`, or, given a `tokenizer`,
    text decoded from random ids."""
    rng = random.Random(seed)
    ins = random_lengths(rng, num_prompts, input_len, range_ratio)
    outs = random_lengths(rng, num_prompts, output_len, range_ratio)
    if tokenizer is None:
        return [
            BenchRequest(None, random_token_ids(rng, n, vocab_size), n, m)
            for n, m in zip(ins, outs, strict=True)
        ]
    texts = random_texts(rng, tokenizer, ins)
    return [BenchRequest(t, None, n, m) for t, n, m in zip(texts, ins, outs, strict=True)]


def file_requests(
    path: str | Path,
    num_prompts: int,
    default_output_len: int,
    count_tokens: Callable[[str], int] | None = None,
) -> list[BenchRequest]:
    """The first `num_prompts` prompts of a file, as text; `count_tokens` gives the client-side
    prompt length (0 without it); prompts without "output_len" get `default_output_len`."""
    return [
        BenchRequest(
            r["prompt"],
            None,
            count_tokens(r["prompt"]) if count_tokens else 0,
            r["output_len"] or default_output_len,
        )
        for r in read_prompt_file(path)[:num_prompts]
    ]


def requests_from_args(
    args, *, vocab_size: int | None = None, tokenizer=None, text: bool = False
) -> list[BenchRequest]:
    """The dataset the flags of `scripts.bench.flags.add_dataset_args` ask for; random prompts
    are text when `text` (decoded by `tokenizer`), else token ids from `vocab_size`."""
    if args.dataset_name == "file":
        count = (lambda prompt: len(tokenizer.encode(prompt))) if tokenizer else None
        return file_requests(args.dataset_path, args.num_prompts, args.random_output_len, count)
    return random_requests(
        args.seed,
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        vocab_size=vocab_size,
        tokenizer=tokenizer if text else None,
    )


@dataclass
class Conversation:
    """A multi-turn chat in token ids: turn k's prompt is `system`, every earlier user message
    followed by the server's answer to it, then `users[k]`."""

    system: list[int]
    users: list[list[int]]
    output_lens: list[int]

    def prompt(self, turn: int, answers: list[list[int]]) -> list[int]:
        ids = list(self.system)
        for user, answer in zip(self.users[:turn], answers, strict=True):
            ids += user + answer
        return ids + self.users[turn]


def multiturn_conversations(
    seed: int,
    num_conversations: int,
    num_turns: int,
    system_len: int,
    user_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
) -> list[Conversation]:
    """Random token ids: one system prompt shared by all conversations, then per turn a user
    message of SGLang's random length in [user_len * ratio, user_len] and an answer length
    likewise."""
    if num_turns < 1 or system_len < 0:
        raise ValueError("--multiturn-turns must be >= 1 and --multiturn-system-len >= 0")
    rng = random.Random(seed)
    system = random_token_ids(rng, system_len, vocab_size)
    conversations = []
    for _ in range(num_conversations):
        users = [
            random_token_ids(rng, n, vocab_size)
            for n in random_lengths(rng, num_turns, user_len, range_ratio)
        ]
        outs = random_lengths(rng, num_turns, output_len, range_ratio)
        conversations.append(Conversation(system, users, outs))
    return conversations


def warmup_subset(dataset: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
    """The first few (prompt ids, output len) pairs with short outputs: a warm-up run that
    keeps first-call costs out of the timed one."""
    return [(ids, min(n, WARMUP_PROMPT_OUTPUT_LEN)) for ids, n in dataset[:WARMUP_PROMPTS]]


# --------------------------------------------------------------------------------------
# static batches (bench_one_batch)


def tokenized_prompt_file(path: str, model_path: str) -> list[list[int]]:
    """Token ids of each prompt of `path`, by the checkpoint's tokenizer (no special tokens)."""
    tokenizer = load_tokenizer(model_path, required=True)
    return [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in read_prompt_file(path)]


def batch_prompts(
    seed: int, batch_size: int, input_len: int, vocab_size: int, file_prompts=None
) -> list[list[int]]:
    """The same prompts for a setting whatever the variant (seeded by the setting): random
    ids, or consecutive `file_prompts` (token ids) long enough, cut to `input_len`."""
    rng = random.Random(f"{seed}-{batch_size}-{input_len}")
    if file_prompts is None:
        return [random_token_ids(rng, input_len, vocab_size) for _ in range(batch_size)]
    long_enough = [ids[:input_len] for ids in file_prompts if len(ids) >= input_len]
    if not long_enough:
        raise ValueError(f"no prompt of --dataset-path has {input_len} tokens; lower --input-len")
    first = rng.randrange(len(long_enough))
    return [long_enough[(first + i) % len(long_enough)] for i in range(batch_size)]


# --------------------------------------------------------------------------------------
# code prompts (make_code_prompts)


def code_prompts(num_prompts: int, prompt_chars: int, holdout_every: int) -> list[str]:
    """The opening `prompt_chars` characters (cut back to a line end) of `num_prompts` evenly
    spaced files the default model held out (the trainer's own split of the standard
    library): in its domain, not in its training data."""
    from training.corpus import split_by_file, stdlib_sources

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
