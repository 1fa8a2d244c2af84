# SPDX-License-Identifier: Apache-2.0
"""The checkpoint's README.md: the family's introduction, architecture table and training
notes around the lines every family shares (corpus, tokenizer, optimisation, held-out
results, the runtime's measured NEXTN speed and acceptance, transformers parity, how to
reproduce)."""

from __future__ import annotations

import math

from training.export import DISTILLER_MODULE, TRAINER_MODULE
from training.families import family_of_config
from training.hot_vocab import HOT_VOCAB_FILE, HOT_VOCAB_SIZE


def _card_data_lines(config: dict, summary: dict) -> list[str]:
    """Corpus, tokenizer and optimisation: the same for every family."""
    corpus = summary["corpus"]
    return [
        f"* Corpus: the standard library `*.py` of Python {corpus['python']} (site-packages "
        f"excluded), sorted by path, every {corpus['holdout_every']}th file held out: "
        f"{corpus['files_train']} train files ({corpus['bytes_train'] / 1e6:.1f} MB, "
        f"{corpus['tokens_train'] / 1e6:.2f} M tokens), {corpus['files_heldout']} held-out files "
        f"({corpus['tokens_heldout'] / 1e6:.2f} M tokens). Each file is framed "
        "`<|bos|> ... <|eos|>`.",
        f"* Tokenizer: byte-level BPE ({config['vocab_size']} entries) trained on the train "
        "split with `tokenizers`; special tokens `<|bos|> <|eos|> <|pad|> <|system|> <|user|> "
        "<|assistant|>`; encoding a text prepends `<|bos|>`.",
        f"* {summary['steps']} steps in {summary['train_minutes']:.1f} minutes on "
        f"{summary['threads']} CPU threads ({summary['train_tokens'] / 1e6:.2f} M tokens): "
        f"batch {summary['batch_size']} x {summary['seq_len']} tokens, AdamW (0.9, 0.95), "
        f"peak lr {summary['lr']:g}, {summary['warmup_steps']} warm-up steps then cosine to "
        f"{summary['min_lr_ratio']:g}x, weight decay {summary['weight_decay']:g}, "
        f"{summary['precision']} autocast, seed {summary['seed']}.",
    ]


def _card_heldout_lines(summary: dict) -> list[str]:
    held = summary["heldout"]
    return [
        "## Held-out results",
        "",
        f"Over {summary['heldout_windows']} windows of {summary['seq_len']} tokens of the held-out "
        "files (training-form model):",
        "",
        "| | loss | top-1 accuracy |",
        "|---|---|---|",
        f"| trunk (next token) | {held['trunk']:.3f} (ppl {math.exp(held['trunk']):.1f}) | "
        f"{held['trunk_acc']:.3f} |",
        f"| MTP (token after next) | {held['mtp']:.3f} | {held['mtp_acc']:.3f} |",
        "",
        f"MTP argmax = trunk's next argmax (the first draft token greedy NEXTN accepts): "
        f"{held['mtp_agreement']:.3f}.",
    ]


def _card_runtime_lines(report: dict) -> list[str]:
    per_pos = ", ".join(f"{r:.3f}" for r in report["accept_rate_per_position"])
    return [
        "",
        "## Served by the runtime",
        "",
        f'`Engine(model_path=DIR, dtype="{report["dtype"]}", cuda_graph_bs=[1], '
        'capture_compile="startup")` (captured batch-1 steps, compiled before timing), greedy, '
        f"{report['max_new_tokens']} new tokens for each of {report['num_prompts']} prompts "
        "(the first lines, up to 320 characters, of held-out files), one at a time (batch 1), "
        f"{report['threads']} torch thread{'s' * (report['threads'] != 1)} with "
        "`OMP_WAIT_POLICY=PASSIVE`:",
        "",
        "| | tokens/s |",
        "|---|---|",
        f"| plain decoding | {report['plain_tokens_per_s']:.1f} |",
        f"| NEXTN, {report['speculative_num_steps']} draft steps | "
        f"{report['nextn_tokens_per_s']:.1f} ({report['speedup']:.2f}x) |",
        "",
        f"* Accept length (tokens per verify round): **{report['accept_length']:.2f}**.",
        f"* Share of rounds that accepted draft 1..{report['speculative_num_steps']}: {per_pos}.",
        f"* Histogram of accepted drafts per round (index m = rounds that accepted m): "
        f"{report['accept_histogram']}.",
        f"* NEXTN output identical to plain greedy output for "
        f"{report['nextn_equals_plain']} of {report['num_prompts']} prompts.",
    ]


def _card_parity_line(hf_class: str, parity: dict) -> str:
    return (
        f"* transformers `{hf_class}.from_pretrained` loads this directory "
        f"(ignoring `mtp.*`); its greedy `generate` equals the runtime's (fp32) on "
        f"{parity['equal']} of {parity['prompts']} prompts "
        f"({parity['new_tokens']} tokens)."
    )


# commands recorded before the trainer had a package of its own (`scripts/`), as run now
_MOVED_COMMANDS = {
    "scripts/train_tiny_model.py": f"-m {TRAINER_MODULE}",
    "-m scripts.train_tiny_model": f"-m {TRAINER_MODULE}",
    "-m scripts.distill_draft": f"-m {DISTILLER_MODULE}",
}


def current_command(command: str) -> str:
    """A recorded command (after `python`) as it runs from the repository root today."""
    for old, new in _MOVED_COMMANDS.items():
        if command == old or command.startswith(old + " "):
            return new + command.removeprefix(old)
    return command


def _trainer_command(summary: dict) -> str:
    """The training command as run from the repository root."""
    return f"python {current_command(summary['command'])}"


def _card_reproduce_lines(summary: dict) -> list[str]:
    return [
        "",
        "## Reproduce",
        "",
        "```bash",
        _trainer_command(summary),
        *(f"python {current_command(r['command'])}" for r in _distillation_rounds(summary)),
        f"python -m {TRAINER_MODULE} --evaluate-only {summary['output_dir']}",
        "```",
        "",
        "Training is deterministic for a given seed, Python standard library and step budget "
        "(`--max-steps N --max-minutes 0`). This checkpoint had a time budget, so its cosine "
        "schedule followed the clock: a rerun trains as many steps as fit in that time on "
        "its machine. Figures above were measured on a shared 2-core CPU (other jobs ran "
        "during training) and vary with its load.",
        "",
    ]


def model_card(config: dict, summary: dict, report: dict | None, parity: dict | None) -> str:
    """README.md of the checkpoint directory, from the training summary and measurements."""
    family = family_of_config(config)
    lines = [
        *family.card_introduction(config),
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        *family.card_architecture(config, summary["params"], summary["size_mb"]),
        "",
        "## Training",
        "",
        *_card_data_lines(config, summary),
        *family.card_training_notes(summary),
        "",
        *_card_heldout_lines(summary),
    ]
    if report is not None:
        lines += _card_runtime_lines(report)
    if parity is not None:
        lines.append(_card_parity_line(family.HF_CLASS_NAME, parity))
    rounds = _distillation_rounds(summary)
    if rounds:
        lines += _card_distillation_lines(rounds)
    lines += _card_hot_vocab_lines()
    lines += _card_reproduce_lines(summary)
    return "\n".join(lines)


def _distillation_rounds(summary: dict) -> list[dict]:
    """The `training.distill_draft` runs on this checkpoint, in order."""
    latest = summary.get("draft_distillation")
    return [*summary.get("earlier_draft_distillations", []), *([latest] if latest else [])]


def _card_distillation_lines(rounds: list[dict]) -> list[str]:
    """What `training.distill_draft` did to the draft, with its held-out chain agreement."""
    runs = [
        f"`python {current_command(r['command'])}` ({r['steps']} steps in "
        f"{r['minutes']:.1f} minutes on {r['threads']} CPU threads, batch {r['batch_size']} x "
        f"{r['seq_len']} tokens of the train split, AdamW, peak lr {r['lr']:g}, seed {r['seed']})"
        for r in rounds
    ]
    first = rounds[0]
    rows = [
        "| "
        + " | ".join(
            [str(k + 1), f"{before:.3f}"] + [f"{r['agreement_after'][k]:.3f}" for r in rounds]
        )
        + " |"
        for k, before in enumerate(first["agreement_before"])
    ]
    after = [f"after run {i + 1}" if len(rounds) > 1 else "after" for i in range(len(rounds))]
    return [
        "",
        "## Draft distillation",
        "",
        f"After training, {' then '.join(runs)} distilled the MTP layer from the frozen "
        f"trunk: the draft runs chained for {first['num_steps']} steps over every row at "
        "once, as the runtime chains it, and each step's distribution is pulled towards the "
        "trunk's (KL divergence). The trunk's weights, and so the model's output, are "
        "unchanged; the figures above are the distilled draft's.",
        "",
        f"Share of held-out rows ({first['heldout_windows']} windows, teacher-forced) "
        "where draft step k's argmax equals the trunk's:",
        "",
        "| draft step | before | " + " | ".join(after) + " |",
        "|---" * (2 + len(rounds)) + "|",
        *rows,
    ]


def _card_hot_vocab_lines() -> list[str]:
    return [
        "",
        "## Draft hot vocabulary",
        "",
        f"`{HOT_VOCAB_FILE}`: the {HOT_VOCAB_SIZE} most frequent token ids of the training "
        "split (and `<|eos|>`), written by the trainer and named in `config.json` "
        "(`speculative_token_map`), so `--speculative-token-map auto` (the default) uses "
        "it: the MTP draft's LM head then scores only these (FR-Spec), a cheaper draft "
        "step with the output unchanged (`none`: the whole vocabulary). "
        "`scripts.make_token_map` writes such a table for any corpus.",
    ]
