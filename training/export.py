# SPDX-License-Identifier: Apache-2.0
"""The checkpoint directory: config.json, model.safetensors in the family's released names
and dtypes (`mtp.*` included), the tokenizer, the draft's hot-vocabulary table and
training.json; and the way back from such a directory to the training-form model."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from runtime.configs.token_map import CHECKPOINT_KEY
from training import REPO_ROOT
from training.corpus import TOKEN_IDS, Corpus, save_tokenizer
from training.families import FAMILIES, family_of_config
from training.hot_vocab import (
    HOT_VOCAB_FILE,
    HOT_VOCAB_SIZE,
    hot_tokens,
    stream_counts,
    write_table,
)
from training.loop import TrainState

TRAINER_MODULE = "training.train_tiny_model"
DISTILLER_MODULE = "training.distill_draft"


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameters of the trunk and the MTP layer (they share the embedding and head)."""
    trunk = sum(p.numel() for p in model.trunk.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    return {"trunk": trunk, "mtp": mtp, "total": trunk + mtp}


def export_checkpoint(model: nn.Module, tokenizer, out_dir: Path) -> float:
    """Write config.json, model.safetensors (released naming, bf16) and the tokenizer into
    `out_dir`; returns the weights file size in MB."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(model.config, indent=2) + "\n")
    weights = out_dir / "model.safetensors"
    state = family_of_config(model.config).released_state_dict(model)
    save_file(state, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors writes 0600; the file ships with the package
    save_tokenizer(tokenizer, out_dir, model.config["max_position_embeddings"])
    return weights.stat().st_size / 1e6


def export_hot_vocab(corpus: Corpus, out_dir: Path) -> None:
    """The training split's most frequent tokens (`<|bos|>`/`<|eos|>` framing left out of
    the ranking, `<|eos|>` added): what `scripts.make_token_map --stdlib-train` writes for
    the same split."""
    framing = {TOKEN_IDS["bos"], TOKEN_IDS["eos"]}
    counts = stream_counts(corpus.train_stream, skip=framing)
    write_table(hot_tokens(counts, HOT_VOCAB_SIZE, [TOKEN_IDS["eos"]]), out_dir / HOT_VOCAB_FILE)
    # the checkpoint names its table, so `--speculative-token-map auto` (the default) uses it
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    config[CHECKPOINT_KEY] = HOT_VOCAB_FILE
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def load_checkpoint(path: Path) -> nn.Module:
    """The training-form model (trunk + MTP, fp32) of a checkpoint the trainer wrote."""
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())
    family = family_of_config(config)
    model = family.TinyModel(config, seed=0)
    family.load_released_state_(model, load_file(str(path / "model.safetensors")))
    return model


def training_summary(args, state: TrainState, model: nn.Module, corpus: Corpus) -> dict:
    """training.json: how the checkpoint was trained (the command, the budget spent, the
    optimisation settings, the parameter counts and the corpus figures)."""
    output = Path(args.output_dir).resolve()
    shown = output.relative_to(REPO_ROOT) if output.is_relative_to(REPO_ROOT) else output
    return {
        "command": " ".join(["-m", TRAINER_MODULE, *args.argv]),  # after `python`
        "output_dir": str(shown),
        "seed": args.seed,
        "steps": state.step,
        "train_minutes": state.elapsed / 60,
        "train_tokens": state.tokens,
        "threads": args.threads,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "min_lr_ratio": args.min_lr_ratio,
        "weight_decay": args.weight_decay,
        "precision": args.precision,
        "mtp_weight": args.mtp_weight,
        "mtp_detach": args.mtp_detach,
        "params": count_parameters(model),
        "corpus": corpus.info,
        **FAMILIES[args.family].training_summary(args, model),
    }
