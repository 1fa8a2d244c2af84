# SPDX-License-Identifier: Apache-2.0
"""The training corpus: the Python standard library of the running interpreter (offline
everywhere, the same on every machine with the same Python), split by file into train and
held-out parts, and a byte-level BPE tokenizer trained on the train part with the special
tokens and chat template the checkpoint ships."""

from __future__ import annotations

import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_HOLDOUT_EVERY = 20

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_MARKERS.values()]  # ids 0..5, in this order
TOKEN_IDS = {
    "bos": SPECIAL_TOKENS.index(BOS),
    "eos": SPECIAL_TOKENS.index(EOS),
    "pad": SPECIAL_TOKENS.index(PAD),
}
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant') }}{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def stdlib_sources(limit_files: int | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of the interpreter's standard library `*.py`, sorted by path.

    Installed packages (site-/dist-packages) are left out: they differ between machines.
    Files that are not UTF-8 (a few deliberate test fixtures) are skipped. `limit_files`
    keeps an evenly spaced subset, so a small slice still has held-out files.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        (p.relative_to(root).as_posix(), p)
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    )
    if limit_files:
        paths = paths[:: max(1, len(paths) // limit_files)][:limit_files]
    sources = []
    for rel, path in paths:
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            sources.append((rel, text))
    return sources


def split_by_file(sources: list, holdout_every: int) -> tuple[list, list]:
    """Every `holdout_every`-th file (0, n, 2n, ...) is held out; the rest trains."""
    held = [s for i, s in enumerate(sources) if i % holdout_every == 0]
    train = [s for i, s in enumerate(sources) if i % holdout_every != 0]
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` with the special tokens at ids 0..5.

    Encoding a single text prepends <|bos|> (as every training document starts with it),
    so prompts served by the runtime look like the start of a training file.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tokenizer


def save_tokenizer(tokenizer, out_dir: Path, max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json that `AutoTokenizer.from_pretrained` loads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": list(ROLE_MARKERS.values()),
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": list(ROLE_MARKERS.values()),
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_documents(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one id stream, each framed `<|bos|> text <|eos|>`."""
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids += [bos, *enc.ids, eos]
    return torch.tensor(ids, dtype=torch.int32)


@dataclass
class Corpus:
    """The tokenizer, both splits as id streams, the held-out files and the corpus figures
    training.json records."""

    tokenizer: object  # tokenizers.Tokenizer
    train_stream: torch.Tensor
    held_stream: torch.Tensor
    held_sources: list
    info: dict


def prepare_corpus(
    work_dir: Path, limit_files: int, holdout_every: int, vocab_size: int, resume: bool
) -> Corpus:
    """Read and split the stdlib, train (or, when resuming, reload from `work_dir`) the
    tokenizer, encode both splits."""
    from tokenizers import Tokenizer

    sources = stdlib_sources(limit_files)
    train_sources, held_sources = split_by_file(sources, holdout_every)
    tok_file = work_dir / "tokenizer.json"
    if resume and tok_file.exists():
        tokenizer = Tokenizer.from_file(str(tok_file))
    else:
        tokenizer = train_tokenizer([text for _, text in train_sources], vocab_size)
        tokenizer.save(str(tok_file))
    train_stream = encode_documents(tokenizer, [text for _, text in train_sources])
    held_stream = encode_documents(tokenizer, [text for _, text in held_sources])
    info = {
        "python": sys.version.split()[0],
        "stdlib": sysconfig.get_paths()["stdlib"],
        "files_train": len(train_sources),
        "files_heldout": len(held_sources),
        "bytes_train": sum(len(t.encode()) for _, t in train_sources),
        "bytes_heldout": sum(len(t.encode()) for _, t in held_sources),
        "tokens_train": len(train_stream),
        "tokens_heldout": len(held_stream),
        "holdout_every": holdout_every,
        "limit_files": limit_files,
        "vocab_size": tokenizer.get_vocab_size(),
    }
    return Corpus(tokenizer, train_stream, held_stream, held_sources, info)


def checkpoint_corpus(path: Path, corpus: dict) -> tuple[object, list, list]:
    """A trained checkpoint's tokenizer and the train / held-out sources it was split into
    (training.json's `corpus`): what later stages (evaluation, draft distillation) read."""
    from tokenizers import Tokenizer

    train, held = split_by_file(stdlib_sources(corpus["limit_files"]), corpus["holdout_every"])
    return Tokenizer.from_file(str(path / "tokenizer.json")), train, held
