# SPDX-License-Identifier: Apache-2.0
"""Helpers shared by the benchmark scripts (`bench_one_batch`, `bench_offline_throughput`,
`bench_serving`): common flags, the plain / NEXTN variants a run compares, SGLang's printed
layout, statistics, the HF transformers baseline and plots.

The scripts are run as files (`python scripts/bench_*.py`), so this module puts the
repository root on `sys.path` for `runtime` to import.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # scripts/ is not a package; make `runtime` importable
    sys.path.insert(0, str(REPO_ROOT))

BLOCK_WIDTH = 50  # SGLang's result blocks are 50 columns wide


# --------------------------------------------------------------------------------------
# flags


def add_model_args(parser: argparse.ArgumentParser, steps_sweep: bool = True) -> None:
    """--model-path, --dtype, the speculative flags, --compare, --threads, --seed."""
    g = parser.add_argument_group("model and decoding")
    g.add_argument(
        "--model-path",
        dest="model_path",
        default=None,
        help="checkpoint directory (default: the engine's embedded tiny model)",
    )
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    g.add_argument("--speculative-algorithm", default=None, help="NEXTN (aliases MTP, EAGLE)")
    g.add_argument(
        "--speculative-num-steps",
        type=int,
        nargs="+" if steps_sweep else None,
        default=None,
        help="draft steps per round (default 3)"
        + ("; several values sweep them, one run each" if steps_sweep else ""),
    )
    g.add_argument("--speculative-eagle-topk", type=int, default=None, help="1 (chain drafting)")
    g.add_argument(
        "--speculative-num-draft-tokens", type=int, default=None, help="verify width (steps + 1)"
    )
    g.add_argument(
        "--compare",
        action="store_true",
        help="run plain decoding and NEXTN back to back and print NEXTN/plain ratios "
        "(NEXTN is implied)",
    )
    g.add_argument(
        "--max-running-requests",
        type=int,
        default=64,
        help="request slots; the same for every variant so they compare fairly",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads, the same for every variant and the HF baseline (default: all cores)",
    )
    g.add_argument("--seed", type=int, default=1, help="seed of the random prompts")
    g.add_argument(
        "--disable-tqdm",
        "--no-progress",
        dest="disable_tqdm",
        action="store_true",
        help="no progress bars",
    )


@dataclass(frozen=True)
class Variant:
    """One decoding configuration a run measures: plain, or NEXTN with its shape."""

    label: str
    spec: dict | None  # Engine / launch_server speculative kwargs, None for plain decoding

    @property
    def is_plain(self) -> bool:
        return self.spec is None

    @property
    def num_steps(self) -> int:
        return 0 if self.spec is None else self.spec["speculative_num_steps"]


def build_variants(args: argparse.Namespace) -> list[Variant]:
    """Plain first (when `--compare` or no algorithm is given), then one NEXTN variant per
    requested step count. Bad speculative flags fail here, before any weight is read."""
    from runtime.configs.speculative import SpeculativeConfig

    steps = args.speculative_num_steps
    steps = steps if isinstance(steps, list) else [steps]
    algorithm = args.speculative_algorithm or ("NEXTN" if args.compare else None)
    variants = []
    if args.compare or algorithm is None:
        if algorithm is None and any(s is not None for s in steps):
            raise ValueError(
                "--speculative-num-steps needs --speculative-algorithm NEXTN (or --compare)"
            )
        variants.append(Variant("plain", None))
    if algorithm is not None:
        for s in steps:
            cfg = SpeculativeConfig.resolve(
                algorithm, s, args.speculative_eagle_topk, args.speculative_num_draft_tokens
            )
            spec = {
                "speculative_algorithm": cfg.algorithm,
                "speculative_num_steps": cfg.num_steps,
                "speculative_eagle_topk": cfg.eagle_topk,
                "speculative_num_draft_tokens": cfg.num_draft_tokens,
            }
            variants.append(Variant(f"{cfg.algorithm}(steps={cfg.num_steps})", spec))
    return variants


def set_threads(threads: int) -> int:
    """Pin torch's intra-op threads so every variant (and the HF baseline) runs alike."""
    import torch

    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def resolve_model_path(model_path: str | None) -> str:
    """The checkpoint directory, or the engine's embedded default (FileNotFoundError if absent)."""
    from runtime.engine.engine import default_model_path

    return model_path or default_model_path()


def resolve_torch_dtype(model_path: str, dtype: str):
    """The torch dtype `Engine(dtype=...)` will run in, so the HF baseline can use the same."""
    from runtime.configs.model_config import ModelConfig

    return ModelConfig.from_path(model_path, dtype).dtype


def make_engine(args: argparse.Namespace, variant: Variant, **overrides):
    """An in-process `Engine` for `variant` with the shared flags (`overrides` win)."""
    from runtime import Engine

    kwargs = {
        "model_path": args.model_path,
        "dtype": args.dtype,
        "max_running_requests": args.max_running_requests,
        "random_seed": args.seed,
        **(variant.spec or {}),
    }
    kwargs.update(overrides)
    return Engine(**kwargs)


def spec_counters(engine) -> tuple[int, int]:
    """(emitted tokens, verify rounds) so far; deltas give a run's own accept length."""
    if not getattr(engine, "spec_config", None):
        return 0, 0
    stats = engine.worker.stats
    return stats.emitted_tokens, stats.verify_rounds


def accept_length_between(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """Tokens per verify round between two `spec_counters` readings (None without rounds)."""
    rounds = after[1] - before[1]
    return (after[0] - before[0]) / rounds if rounds else None


# --------------------------------------------------------------------------------------
# prompts


def random_token_ids(rng: random.Random, length: int, vocab_size: int, low: int = 0) -> list[int]:
    """`length` ids drawn uniformly from [low, vocab_size)."""
    return [rng.randrange(low, vocab_size) for _ in range(length)]


def random_lengths(rng: random.Random, count: int, full: int, range_ratio: float) -> list[int]:
    """SGLang's random dataset lengths: uniform in [max(1, full * ratio), full]."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}")
    low = max(int(full * range_ratio), 1)
    return [rng.randint(low, max(full, low)) for _ in range(count)]


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


# --------------------------------------------------------------------------------------
# printing


def block_header(title: str = "", fill: str = "=") -> str:
    """SGLang's centred header line, e.g. '====== Serving Benchmark Result ======'."""
    text = f" {title} " if title and fill == "=" else title
    return f"{text:{fill}^{BLOCK_WIDTH}}"


def block_row(label: str, value) -> str:
    """SGLang's row: 40-column label, then the value (floats with 2 decimals)."""
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def ratio(num: float | None, den: float | None) -> float:
    return num / den if num is not None and den else float("nan")


def ratio_line(label: str, num: float, den: float) -> str:
    """One clearly labelled ratio, e.g. 'NEXTN(steps=3)/plain output tok/s: 1.234x'."""
    return f"{label}: {ratio(num, den):.3f}x"


def print_table(columns: list[str], rows: list[list]) -> None:
    """A markdown table, floats with 2 decimals (None prints as n/a)."""

    def cell(v):
        if v is None:
            return "n/a"
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")


def append_jsonl(path: str | None, record: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def progress(iterable=None, disable: bool = False, **kwargs):
    """A tqdm bar on stderr (stdout stays clean for the results)."""
    from tqdm import tqdm

    return tqdm(iterable, disable=disable, file=sys.stderr, leave=False, **kwargs)


def percentiles(values: list[float], *, scale: float = 1000.0) -> dict:
    """mean/median/std/p90/p95/p99/max of `values` (seconds) in ms; zeros when empty."""
    import numpy as np

    if not values:
        return dict.fromkeys(("mean", "median", "std", "p90", "p95", "p99", "max"), 0.0)
    arr = np.asarray(values, dtype=float) * scale
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "std": float(arr.std()),
        "p90": float(np.percentile(arr, 90)),
        "p95": float(np.percentile(arr, 95)),
        "p99": float(np.percentile(arr, 99)),
        "max": float(arr.max()),
    }


def run_config(args: argparse.Namespace, model_path: str, torch_threads: int | None) -> dict:
    """The settings every JSONL record carries, so results read on their own."""
    return {
        "model_path": model_path,
        "dtype": args.dtype,
        "threads": torch_threads,
        "max_running_requests": args.max_running_requests,
        "seed": args.seed,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


# --------------------------------------------------------------------------------------
# HF transformers baseline


class TokenClock:
    """A `generate` streamer that only records when each step's tokens arrive: the first
    `put` is the prompt, the second the first new token (after prefill), then one per step."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_hf_model(model_path: str, torch_dtype, quiet: bool = False):
    """transformers' own implementation of the checkpoint, in `torch_dtype`, eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # generation-config chatter is noise here
    if quiet:
        transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    return model.eval()


def hf_generate(model, input_ids, attention_mask, new_tokens: int):
    """Greedy `generate` of exactly `new_tokens` per row; returns (output ids, TokenClock,
    start time). EOS is switched off (`eos_token_id=None`) as ignore_eos does for us: with
    an EOS id, `min_new_tokens` would mask its logit and change the greedy tokens."""
    import torch

    clock = TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            streamer=clock,
        )
    end = time.perf_counter()
    if out.shape[1] - input_ids.shape[1] != new_tokens:
        raise RuntimeError(
            f"HF generate produced {out.shape[1] - input_ids.shape[1]} tokens, "
            f"expected {new_tokens}"
        )
    clock.times.append(end)
    return out[:, input_ids.shape[1] :], clock, start


# --------------------------------------------------------------------------------------
# plots


def save_plot(
    path: str,
    x_label: str,
    series: dict[str, tuple[list, list]],
    accept: dict[str, tuple[list, list]],
    y_label: str = "tokens/s",
    log_x: bool = False,
) -> None:
    """Lines of tokens/s (left axis) and accept length (right axis, dashed, same colour as
    its series) against x."""
    try:
        import matplotlib
    except ImportError:
        print("--plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {}
    for name, (xs, ys) in series.items():
        (line,) = ax.plot(xs, ys, marker="o", label=name)
        colours[name] = line.get_color()
    xs_all = sorted({x for xs, _ in series.values() for x in xs})
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs_all, [str(x) for x in xs_all])
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if accept:
        ax2 = ax.twinx()
        for name, (xs, ys) in accept.items():
            ax2.plot(
                xs,
                ys,
                marker="s",
                linestyle="--",
                color=colours.get(name),
                label=f"{name}: accept length",
            )
        ax2.set_ylabel("accept length (tokens / verify round)")
        ax2.set_ylim(bottom=0)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")
