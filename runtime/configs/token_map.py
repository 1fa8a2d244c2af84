# SPDX-License-Identifier: Apache-2.0
"""The draft's hot vocabulary (`--speculative-token-map`): the token ids its LM head scores.

FR-Spec (Zhao et al., 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling") restricts the draft's output layer to the most
frequent tokens of a corpus. SGLang reads the same table with `--speculative-token-map`: a
file `torch.save`d from a list or 1-D integer tensor of token ids (FR-Spec publishes them as
`freq_32768.pt`). A JSON list of ids is read too. `scripts/make_token_map.py` writes one.

Only the draft's proposals change: the target verifies every token, so output stays exactly
what plain decoding gives whatever the table holds.

A checkpoint may ship its own table and name it in its `config.json`
(`"speculative_token_map": "freq_2048.json"`, a path relative to the checkpoint's
directory), as EAGLE-3 drafts carry their reduced vocabulary (`d2t`) in the checkpoint
itself. The flag's default, `auto`, uses that table where the checkpoint names one and the
whole vocabulary elsewhere; `none` always scores the whole vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

AUTO = "auto"  # the checkpoint's own table, if its config names one
NONE = "none"  # the whole vocabulary
CHECKPOINT_KEY = "speculative_token_map"  # the key of a checkpoint's config.json naming it


def checkpoint_token_map(model_path: str | Path) -> str | None:
    """The table a checkpoint names for its draft (`speculative_token_map` in its
    config.json, relative to its directory), None where it names none. ValueError naming
    the key when the named file is missing."""
    config_file = Path(model_path) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None  # no readable config: the model loader reports that
    name = config.get(CHECKPOINT_KEY) if isinstance(config, dict) else None
    if not name:
        return None
    table = Path(model_path) / str(name)
    if not table.is_file():
        raise ValueError(
            f"{config_file} names the draft's token map '{name}' ({CHECKPOINT_KEY}), but "
            f"{table} does not exist; restore it, or pass --speculative-token-map none (the "
            "whole vocabulary) or a table of your own"
        )
    return str(table)


def resolve_token_map(value: str | Path | None, model_path: str | Path | None) -> str | None:
    """The table `--speculative-token-map value` means for the checkpoint at `model_path`:
    `auto` (and None, unset) its own table or None (also without a checkpoint), `none`
    None, else `value` itself."""
    if value is None or str(value).strip().lower() == AUTO:
        return None if model_path is None else checkpoint_token_map(model_path)
    if str(value).strip().lower() == NONE:
        return None
    return str(value)


def load_token_map(path: str | Path) -> tuple[int, ...]:
    """The table's token ids, sorted and unique. ValueError naming the flag when the file
    is missing, unreadable or not a non-empty list of non-negative integer ids."""
    flag = f"--speculative-token-map '{path}'"
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{flag} does not exist or is not a file")
    try:
        if file.suffix.lower() == ".json":
            raw = json.loads(file.read_text())
        else:
            raw = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # any reader's error: the file is not a token table
        raise ValueError(
            f"{flag} is not a token table (a torch.save'd list or 1-D tensor of token "
            f"ids, or a JSON list): {err}"
        ) from None
    ids = _as_id_list(raw, flag)
    if not ids:
        raise ValueError(f"{flag} holds no token ids")
    if min(ids) < 0:
        raise ValueError(f"{flag} holds a negative token id ({min(ids)})")
    return tuple(sorted(set(ids)))


def check_token_map(ids: tuple[int, ...], vocab_size: int) -> None:
    """ValueError when an id is past the model's vocabulary (a table made for another
    tokenizer)."""
    if ids and ids[-1] >= vocab_size:
        raise ValueError(
            f"--speculative-token-map holds token id {ids[-1]}, outside the model's "
            f"vocabulary of {vocab_size}: was it made with this model's tokenizer?"
        )


def _as_id_list(raw, flag: str) -> list[int]:
    if isinstance(raw, torch.Tensor):
        if raw.dim() != 1 or raw.dtype.is_floating_point or raw.dtype == torch.bool:
            raise ValueError(
                f"{flag}: expected a 1-D integer tensor of token ids, got "
                f"{raw.dtype} of shape {tuple(raw.shape)}"
            )
        return raw.tolist()
    if isinstance(raw, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in raw
    ):
        return list(raw)
    raise ValueError(
        f"{flag}: expected a list of integer token ids, got {type(raw).__name__}"
        + (" holding other values" if isinstance(raw, (list, tuple)) else "")
    )
