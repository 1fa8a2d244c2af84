# SPDX-License-Identifier: Apache-2.0
"""Train a tiny model with one MTP (NextN) layer on CPU: the embedded default DeepSeek-V4,
or a Qwen4Exp (`--family qwen4_exp`).

The corpus is the Python standard library of the running interpreter (offline everywhere),
split by file into train and held-out parts. The script trains a byte-level BPE tokenizer,
then the family's trunk (transformers' modules, training mode, no cache) together with one
MTP layer whose math is exactly the runtime's draft. The families live in
`scripts/tiny_training/` (model, released checkpoint names, model-card lines); this file is
the shared driver: corpus, tokenizer, training loop, export and evaluation.

Loss = CE(trunk, t_{i+1}) + mtp_weight * CE(MTP, t_{i+2}) (+ the family's router balancing
term). The output directory is a released-naming checkpoint (bf16 safetensors, `mtp.*`
included), config.json, the tokenizer and a README model card with held-out losses and the
runtime's measured NEXTN acceptance and speed.

    python scripts/train_tiny_model.py --max-minutes 60           # train, export, evaluate
    python scripts/train_tiny_model.py --resume --max-minutes 90  # continue from --work-dir
    python scripts/train_tiny_model.py --evaluate-only runtime/assets/deepseek_v4_tiny
    python scripts/train_tiny_model.py --family qwen4_exp --output-dir /ckpt/qwen4_exp_tiny
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

# Threads that wait at OpenMP barriers must sleep, not spin: with 2 threads on 2 shared
# cores, a spinning thread starves its partner whenever another process runs, and steps
# become 5-50x slower. Set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
# scripts/ is not a package: make `runtime` and the family modules beside this file importable
for _path in (REPO_ROOT, Path(__file__).resolve().parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from tiny_training import FAMILIES, family_of_config  # noqa: E402

STATE_FILE = "train_state.pt"

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


# ---------------------------------------------------------------------------------------
# Corpus and tokenizer
# ---------------------------------------------------------------------------------------


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


def count_parameters(model: nn.Module) -> dict[str, int]:
    trunk = sum(p.numel() for p in model.trunk.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    return {"trunk": trunk, "mtp": mtp, "total": trunk + mtp}


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------


@dataclass
class TrainState:
    step: int = 0
    elapsed: float = 0.0  # training seconds so far, across resumes
    tokens: int = 0


def sample_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `seq + 2` tokens (inputs, next and after-next targets)."""
    starts = torch.randint(0, len(stream) - seq - 2, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq + 2] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor, count: int, seq: int) -> torch.Tensor:
    """`count` evenly spaced windows of the held-out stream (the same every time)."""
    count = max(1, min(count, (len(stream) - 1) // (seq + 2)))
    starts = torch.linspace(0, len(stream) - seq - 2, count).long()
    return torch.stack([stream[s : s + seq + 2] for s in starts.tolist()])


def losses(model: nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Cross-entropies of the trunk (t_{i+1}) and the MTP (t_{i+2}), plus top-1 agreement
    of the MTP with the trunk's next prediction (what greedy NEXTN accepts as draft 1)."""
    seq = tokens.shape[1] - 2
    trunk_logits, mtp_logits = model(tokens)
    targets = tokens.long()
    trunk = F.cross_entropy(trunk_logits.flatten(0, 1).float(), targets[:, 1 : seq + 1].flatten())
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), targets[:, 2:].flatten())
    with torch.no_grad():
        trunk_pred, mtp_pred = trunk_logits.argmax(-1), mtp_logits.argmax(-1)
        agree = (mtp_pred[:, :-1] == trunk_pred[:, 1:]).float().mean()
        trunk_acc = (trunk_pred == targets[:, 1 : seq + 1]).float().mean()
        mtp_acc = (mtp_pred == targets[:, 2:]).float().mean()
    return {
        "trunk": trunk,
        "mtp": mtp,
        "trunk_acc": trunk_acc,
        "mtp_acc": mtp_acc,
        "mtp_agreement": agree,
    }


@torch.no_grad()
def evaluate_heldout(model: nn.Module, windows: torch.Tensor, batch: int, autocast: bool) -> dict:
    """Mean held-out losses / accuracies over fixed windows."""
    model.eval()
    totals: dict[str, float] = {}
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            result = losses(model, chunk)
        for k, v in result.items():
            totals[k] = totals.get(k, 0.0) + v.item() * len(chunk)
    model.train()
    return {k: v / len(windows) for k, v in totals.items()}


def make_optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms, biases, mHC mixers, sinks)."""
    decay, rest = [], []
    for name, param in model.named_parameters():
        plain_matrix = param.ndim >= 2 and "hc" not in name
        (decay if plain_matrix else rest).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def learning_rate(args, state: TrainState) -> float:
    """Linear warm-up, then cosine to `min_lr_ratio * lr`; progress is whichever of the step
    and time budgets is further along, so the schedule ends when training does."""
    if state.step < args.warmup_steps:
        return args.lr * (state.step + 1) / args.warmup_steps
    progress = 0.0
    if args.max_steps:
        progress = max(progress, state.step / args.max_steps)
    if args.max_minutes:
        progress = max(progress, state.elapsed / (60 * args.max_minutes))
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def budget_left(args, state: TrainState) -> bool:
    if args.max_steps and state.step >= args.max_steps:
        return False
    return not (args.max_minutes and state.elapsed >= 60 * args.max_minutes)


def save_state(path: Path, model, optimizer, state: TrainState, gen, config) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "state": vars(state),
            "data_rng": gen.get_state(),
            "config": config,
        },
        tmp,
    )
    os.replace(tmp, path)  # never leave a half-written state behind


def train(args, model: nn.Module, train_stream, held_windows, work_dir: Path) -> TrainState:
    """The training loop: stops at --max-steps / --max-minutes, saving its state as it goes."""
    from tqdm import tqdm

    optimizer = make_optimizer(model, args)
    balancer = FAMILIES[args.family].make_balancer(model, args)
    gen = torch.Generator().manual_seed(args.seed + 2)
    state, state_path = TrainState(), work_dir / STATE_FILE
    if args.resume and state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        gen.set_state(saved["data_rng"])
        state = TrainState(**saved["state"])
        print(f"resumed from {state_path} at step {state.step}", flush=True)
    model.train()
    interactive = sys.stderr.isatty()
    bar = tqdm(
        total=args.max_steps or None,
        initial=state.step,
        dynamic_ncols=interactive,
        mininterval=2 if interactive else 30,
        desc="train",
    )
    last_save = last_eval = state.elapsed
    while budget_left(args, state):
        started = time.perf_counter()
        lr = learning_rate(args, state)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tokens = sample_batch(train_stream, args.batch_size, args.seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            result = losses(model, tokens)
        loss = result["trunk"] + args.mtp_weight * result["mtp"]
        balance = balancer.loss()  # None where routers balance without a loss term
        if balance is not None:
            loss = loss + balance
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        balancer.update()
        state.step += 1
        state.tokens += tokens.numel() - 2 * len(tokens)
        state.elapsed += time.perf_counter() - started
        bar.update(1)
        bar.set_postfix(
            loss=f"{result['trunk'].item():.3f}",
            mtp=f"{result['mtp'].item():.3f}",
            agree=f"{result['mtp_agreement'].item():.2f}",
            lr=f"{lr:.1e}",
            min=f"{state.elapsed / 60:.1f}",
            refresh=False,
        )
        if state.elapsed - last_eval >= 60 * args.eval_every_minutes:
            last_eval = state.elapsed
            held = evaluate_heldout(model, held_windows, args.batch_size, args.precision == "bf16")
            bar.write(f"step {state.step} ({state.elapsed / 60:.1f} min): held-out " + _fmt(held))
        if state.elapsed - last_save >= 60 * args.save_every_minutes:
            last_save = state.elapsed
            save_state(state_path, model, optimizer, state, gen, model.config)
    bar.close()
    save_state(state_path, model, optimizer, state, gen, model.config)
    return state


def _fmt(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


# ---------------------------------------------------------------------------------------
# Corpus preparation, export
# ---------------------------------------------------------------------------------------


@dataclass
class Corpus:
    tokenizer: object  # tokenizers.Tokenizer
    train_stream: torch.Tensor
    held_stream: torch.Tensor
    held_sources: list
    info: dict


def prepare_corpus(args, work_dir: Path) -> Corpus:
    """Read and split the stdlib, train (or, when resuming, reload) the tokenizer, encode."""
    from tokenizers import Tokenizer

    sources = stdlib_sources(args.corpus_limit_files)
    train_sources, held_sources = split_by_file(sources, args.holdout_every)
    tok_file = work_dir / "tokenizer.json"
    if args.resume and tok_file.exists():
        tokenizer = Tokenizer.from_file(str(tok_file))
    else:
        tokenizer = train_tokenizer([text for _, text in train_sources], args.vocab_size)
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
        "holdout_every": args.holdout_every,
        "limit_files": args.corpus_limit_files,
        "vocab_size": tokenizer.get_vocab_size(),
    }
    return Corpus(tokenizer, train_stream, held_stream, held_sources, info)


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


def load_checkpoint(path: Path) -> nn.Module:
    """The training-form model (trunk + MTP, fp32) of a checkpoint this script wrote."""
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())
    family = family_of_config(config)
    model = family.TinyModel(config, seed=0)
    family.load_released_state_(model, load_file(str(path / "model.safetensors")))
    return model


# ---------------------------------------------------------------------------------------
# Evaluation with the runtime (and transformers as an oracle)
# ---------------------------------------------------------------------------------------


def eval_prompts(held_sources: list, count: int, min_chars=200, max_chars=320) -> list[str]:
    """The opening of `count` evenly spaced held-out files, cut at a line end."""
    usable = [text for _, text in held_sources if len(text) > max_chars]
    picked = usable[:: max(1, len(usable) // count)][:count]
    prompts = []
    for text in picked:
        cut = text.rfind("\n", min_chars, max_chars)
        prompts.append(text[: cut + 1] if cut >= 0 else text[:max_chars])
    return prompts


def _warm_up(engine, prompt: str, params: dict) -> None:
    engine.generate(prompt, {**params, "max_new_tokens": 8})


def _timed_generate(engine, prompts: list[str], params: dict) -> tuple[list[dict], float]:
    """Batch-1 generation of each prompt in turn; (results, seconds)."""
    results, seconds = [], 0.0
    for prompt in prompts:
        started = time.perf_counter()
        results.append(engine.generate(prompt, params))
        seconds += time.perf_counter() - started
    return results, seconds


def _tokens_per_s(results: list[dict], seconds: float) -> float:
    return sum(len(r["output_ids"]) for r in results) / seconds


def pick_dtype(path: Path, prompts: list[str], params: dict) -> tuple[str, dict[str, float]]:
    """The faster of float32 and bfloat16 for plain batch-1 decoding of `prompts`."""
    from runtime import Engine

    speeds = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(model_path=str(path), dtype=dtype)
        _warm_up(engine, prompts[0], params)
        speeds[dtype] = _tokens_per_s(*_timed_generate(engine, prompts, params))
    return max(speeds, key=speeds.get), speeds


def runtime_report(path: Path, prompts: list[str], dtype: str, steps: int, new_tokens: int) -> dict:
    """Serve the checkpoint with the runtime, plain and with NEXTN: speed and acceptance.
    `dtype="auto"` first measures which of float32 / bfloat16 decodes faster."""
    from runtime import Engine

    params = {"temperature": 0, "max_new_tokens": new_tokens}
    dtype_speeds = None
    if dtype == "auto":
        dtype, dtype_speeds = pick_dtype(path, prompts[:4], params)
    plain = Engine(model_path=str(path), dtype=dtype)
    _warm_up(plain, prompts[0], params)
    plain_results, plain_seconds = _timed_generate(plain, prompts, params)
    del plain
    nextn = Engine(
        model_path=str(path),
        dtype=dtype,
        speculative_algorithm="NEXTN",
        speculative_num_steps=steps,
    )
    _warm_up(nextn, prompts[0], params)
    stats = nextn.worker.stats  # engine-wide counters: take the difference over the prompts
    rounds0, emitted0 = stats.verify_rounds, stats.emitted_tokens
    accepted0 = list(stats.accepted_at)
    nextn_results, nextn_seconds = _timed_generate(nextn, prompts, params)
    rounds = stats.verify_rounds - rounds0
    histogram = [0] * (steps + 1)
    for result in nextn_results:
        for m, n in enumerate(result["meta_info"]["spec_accept_histogram"]):
            histogram[m] += n
    plain_speed = _tokens_per_s(plain_results, plain_seconds)
    nextn_speed = _tokens_per_s(nextn_results, nextn_seconds)
    return {
        "dtype": dtype,
        "dtype_plain_tokens_per_s": dtype_speeds,
        "threads": torch.get_num_threads(),
        "num_prompts": len(prompts),
        "max_new_tokens": new_tokens,
        "speculative_num_steps": steps,
        "accept_length": (stats.emitted_tokens - emitted0) / rounds,
        "accept_rate_per_position": [
            (a - a0) / rounds for a, a0 in zip(stats.accepted_at, accepted0, strict=True)
        ],
        "accept_histogram": histogram,
        "plain_tokens_per_s": plain_speed,
        "nextn_tokens_per_s": nextn_speed,
        "speedup": nextn_speed / plain_speed,
        "nextn_equals_plain": sum(
            p["output_ids"] == s["output_ids"]
            for p, s in zip(plain_results, nextn_results, strict=True)
        ),
        "sample": {"prompt": prompts[0], "completion": nextn_results[0]["text"]},
    }


def transformers_parity(path: Path, prompts: list[str], new_tokens: int = 32) -> dict:
    """transformers loads the directory (ignoring `mtp.*`), and its greedy `generate`
    equals the runtime's greedy output in fp32."""
    from transformers import AutoTokenizer

    from runtime import Engine

    family = family_of_config(json.loads((path / "config.json").read_text()))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = family.hf_causal_lm().from_pretrained(str(path), dtype=torch.float32).eval()
    engine = Engine(model_path=str(path), dtype="float32")
    equal = []
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        ours = engine.generate(
            input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": new_tokens}
        )
        equal.append(out[0, len(ids) :].tolist() == ours["output_ids"])
    return {"prompts": len(prompts), "new_tokens": new_tokens, "equal": sum(equal)}


# ---------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------


def _dtype_note(report: dict) -> str:
    speeds = report.get("dtype_plain_tokens_per_s")
    if not speeds:
        return ""
    shown = ", ".join(f"{dtype} {speed:.1f}" for dtype, speed in speeds.items())
    return f" ({report['dtype']} is the faster here; plain tokens/s on 4 prompts: {shown})"


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
        f'`Engine(model_path=DIR, dtype="{report["dtype"]}")`, greedy, '
        f"{report['max_new_tokens']} new tokens for each of {report['num_prompts']} prompts "
        "(the first lines, up to 320 characters, of held-out files), one at a time (batch 1), "
        f"{report['threads']} torch threads with `OMP_WAIT_POLICY=PASSIVE`"
        + _dtype_note(report)
        + ":",
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


def _card_reproduce_lines(summary: dict) -> list[str]:
    return [
        "",
        "## Reproduce",
        "",
        "```bash",
        f"python {summary['command']}",
        f"python scripts/train_tiny_model.py --evaluate-only {summary['output_dir']}",
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
    lines += _card_reproduce_lines(summary)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------


def evaluate_checkpoint(path: Path, args) -> dict:
    """Held-out losses of the saved weights, the runtime's NEXTN acceptance and speed, and
    transformers parity; writes evaluation.json and README.md into `path`."""
    from tokenizers import Tokenizer

    summary = json.loads((path / "training.json").read_text())
    config = json.loads((path / "config.json").read_text())
    corpus = summary["corpus"]
    _, held_sources = split_by_file(stdlib_sources(corpus["limit_files"]), corpus["holdout_every"])
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    windows = eval_windows(
        encode_documents(tokenizer, [t for _, t in held_sources]),
        args.eval_windows,
        summary["seq_len"],
    )
    model = load_checkpoint(path)
    summary["heldout"] = evaluate_heldout(model, windows, summary["batch_size"], autocast=False)
    summary["heldout_windows"] = len(windows)
    del model
    print("held-out: " + _fmt(summary["heldout"]), flush=True)
    report = parity = None
    if not args.skip_runtime_eval:
        prompts = eval_prompts(held_sources, args.eval_prompts)
        report = runtime_report(
            path, prompts, args.eval_dtype, args.spec_steps, args.eval_new_tokens
        )
        parity = transformers_parity(path, prompts[:2])
        print(json.dumps({**report, "transformers_parity": parity}, indent=2), flush=True)
    (path / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    (path / "evaluation.json").write_text(
        json.dumps(
            {"heldout": summary["heldout"], "runtime": report, "transformers_parity": parity},
            indent=2,
        )
        + "\n"
    )
    (path / "README.md").write_text(model_card(config, summary, report, parity))
    return {"heldout": summary["heldout"], "runtime": report, "transformers_parity": parity}


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
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
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
    data.add_argument("--holdout-every", type=int, default=20)
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
    ev.add_argument(
        "--skip-runtime-eval",
        action="store_true",
        help="held-out losses only (no runtime speed / acceptance, no parity check)",
    )
    ev.add_argument("--eval-windows", type=int, default=64)
    ev.add_argument("--eval-prompts", type=int, default=20)
    ev.add_argument("--eval-new-tokens", type=int, default=64)
    ev.add_argument(
        "--eval-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="runtime dtype for the speed figures; auto: the faster one",
    )
    ev.add_argument("--spec-steps", type=int, default=3)
    args = p.parse_args(argv)
    args.argv = argv
    return args


def _training_summary(args, state: TrainState, model: nn.Module, corpus: Corpus) -> dict:
    output = Path(args.output_dir).resolve()
    shown = output.relative_to(REPO_ROOT) if output.is_relative_to(REPO_ROOT) else output
    return {
        "command": " ".join(["scripts/train_tiny_model.py", *args.argv]),
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


def warn_if_slow_precision(precision: str) -> None:
    """bf16 matmuls have fast CPU kernels only with AVX512 (BF16/AMX); on an AVX2 CPU torch
    falls back to a scalar GEMM, measured ~10x slower per training step than fp32."""
    capability = torch.backends.cpu.get_cpu_capability()
    if precision == "bf16" and not capability.startswith("AVX512"):
        print(
            f"warning: this CPU's best vector ISA is {capability}, where bf16 matmuls are about "
            "10x slower than fp32; pass --precision fp32 (the default model was trained with "
            "bf16 autocast on an AVX512 CPU)",
            file=sys.stderr,
            flush=True,
        )


def main(argv=None) -> dict:
    """Train, export and evaluate (or only evaluate); returns the evaluation figures."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.evaluate_only:
        return evaluate_checkpoint(Path(args.evaluate_only), args)
    warn_if_slow_precision(args.precision)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    corpus = prepare_corpus(args, work_dir)
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
    summary = _training_summary(args, state, model, corpus)
    summary["size_mb"] = export_checkpoint(model, corpus.tokenizer, output)
    (output / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"wrote {output} ({summary['size_mb']:.1f} MB) after {state.step} steps, "
        f"{state.elapsed / 60:.1f} min",
        flush=True,
    )
    return evaluate_checkpoint(output, args)


if __name__ == "__main__":
    main()
