# SPDX-License-Identifier: Apache-2.0
"""The command-line flags the benchmarks share, each written once.

Names follow SGLang's `bench_one_batch`, `bench_offline_throughput` and `bench_serving`
(`--dataset-name`, `--random-input-len`, `--random-range-ratio`, ...) and the server's own
flags (`--page-size`, `--max-total-tokens`, `--chunked-prefill-size`, the speculative ones).
Engine settings take their defaults (and, where the flag is the engine's own, their help)
from `runtime.configs.engine_config.EngineConfig`, so a benchmark measures what `Engine()`
and `launch_server` run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from runtime.configs.engine_config import DEFAULT_MAX_RUNNING_REQUESTS, EngineConfig

ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
DEFAULT_MAX_TOTAL_TOKENS = ENGINE_DEFAULTS["max_total_tokens"]


def new_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the first paragraph of `doc` and whose usage line shows
    how the tool is run (`python -m scripts.NAME`)."""
    return argparse.ArgumentParser(
        prog=f"python -m {prog}",
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_model_args(parser: argparse.ArgumentParser, steps_sweep: bool = True) -> None:
    """--model-path, --dtype, --device, the speculative flags, --compare, --max-running-requests,
    --threads, --seed, --disable-tqdm."""
    g = parser.add_argument_group("model and decoding")
    g.add_argument(
        "--model-path",
        dest="model_path",
        default=None,
        help="checkpoint directory (default: the engine's embedded tiny model)",
    )
    add_engine_flag(g, "dtype")
    g.add_argument(
        "--device",
        default=ENGINE_DEFAULTS["device"],
        help="torch device of our engine and the HF baseline (cpu, cuda, cuda:1, ...)",
    )
    add_engine_flag(g, "quantization")
    add_engine_flag(g, "speculative_algorithm")
    sweep = "; several values sweep them, one run each"
    add_engine_flag(g, "speculative_num_steps", sweep=sweep if steps_sweep else None)
    add_engine_flag(g, "speculative_eagle_topk")
    add_engine_flag(g, "speculative_num_draft_tokens")
    # unset: the engine's own default (`variants` passes the flag only when given)
    add_engine_flag(g, "speculative_disable_by_batch_size", default=None)
    add_engine_flag(g, "speculative_token_map", default=None, sweep=sweep if steps_sweep else None)
    g.add_argument(
        "--compare",
        action="store_true",
        help="run plain decoding and NEXTN back to back and print NEXTN/plain ratios "
        "(NEXTN is implied)",
    )
    g.add_argument(
        "--compare-fused-round",
        action="store_true",
        help="NEXTN: run each NEXTN variant twice, its greedy rounds as one captured graph and "
        "step by step (--disable-fused-nextn-round), taking turns in the same run",
    )
    g.add_argument(
        "--max-running-requests",
        type=int,
        default=DEFAULT_MAX_RUNNING_REQUESTS,
        help="request slots; the same for every variant so they compare fairly (the engine "
        "itself defaults to fewer with NEXTN)",
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


def add_engine_flag(group, name: str, *, sweep: str | None = None, **changes) -> argparse.Action:
    """The engine's own flag for `EngineConfig` field `name` (names, type, default, help:
    `EngineConfig.cli_argument`), with `changes` to its options; `sweep` (help text) lets it
    take several values, one run each."""
    flags, options = EngineConfig.cli_argument(name)
    options.update(changes)
    if sweep is not None:
        options.update(nargs="+", help=(options["help"] or "") + sweep)
    return group.add_argument(*flags, **options)


def add_cache_args(
    parser: argparse.ArgumentParser, *, max_total_tokens: bool = True, chunked_prefill: bool = True
) -> None:
    """The engine's --page-size, and optionally --max-total-tokens and --chunked-prefill-size
    (names, defaults and help from `EngineConfig`)."""
    names = ["page_size"]
    names += ["max_total_tokens"] if max_total_tokens else []
    names += ["chunked_prefill_size"] if chunked_prefill else []
    EngineConfig.add_cli_args(parser, names=names)


CAPTURE_FLAGS = (
    "disable_cuda_graph",
    "cuda_graph_bs",
    "cuda_graph_max_bs",
    "capture_compile",
    "disable_narrow_weights",
    "disable_fused_nextn_round",
    "enable_torch_compile",
)


def add_capture_args(parser: argparse.ArgumentParser) -> None:
    """The engine's captured-step flags. A benchmark compiles a bucket inline the first time
    a warm-up step needs it (not in the background), so measured steps replay it."""
    EngineConfig.add_cli_args(parser, names=CAPTURE_FLAGS)
    parser.set_defaults(capture_compile="inline")


def capture_overrides(args: argparse.Namespace) -> dict:
    """The captured-step settings of parsed flags, as `Engine` keyword arguments."""
    return {name: getattr(args, name) for name in CAPTURE_FLAGS if hasattr(args, name)}


def add_dataset_args(
    parser: argparse.ArgumentParser, num_prompts: int, multiturn: bool = False
) -> None:
    """SGLang's dataset flags: random prompts or a prompt file, how many, how long. With
    `multiturn`, also multi-turn chats (`bench_serving`): --num-prompts conversations of
    --multiturn-turns turns after a shared --multiturn-system-len system prompt, user
    messages of --random-input-len tokens and answers of --random-output-len."""
    parser.add_argument(
        "--dataset-name",
        choices=("random", "file", "multiturn") if multiturn else ("random", "file"),
        default=None,
        help="random prompts, or the prompts of --dataset-path (default: file when "
        "--dataset-path is given)"
        + ("; multiturn: chats whose turn k+1 resends turns 1..k" if multiturn else ""),
    )
    parser.add_argument(
        "--dataset-path",
        help='JSONL with "prompt" (and optional "output_len"), or one prompt per line',
    )
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument(
        "--random-output-len",
        type=int,
        default=64,
        help="output length of random prompts, and of file prompts without one",
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len * ratio, len] (SGLang); 1.0 = fixed lengths",
    )
    if multiturn:
        parser.add_argument("--multiturn-turns", type=int, default=4, help="turns per chat")
        parser.add_argument(
            "--multiturn-system-len",
            type=int,
            default=256,
            help="tokens of the system prompt every conversation starts with",
        )


def check_dataset_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject bad dataset flags (exit 2) and fill the default `--dataset-name`."""
    if args.num_prompts < 1:
        parser.error("--num-prompts must be >= 1")
    if args.dataset_name is None:
        args.dataset_name = "file" if args.dataset_path else "random"
    if args.dataset_name == "file" and not args.dataset_path:
        parser.error("--dataset-name file needs --dataset-path")


def add_hf_baseline_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hf-baseline",
        action="store_true",
        help="also run HF transformers generate and print ours/HF ratios",
    )
    parser.add_argument(
        "--hf-same-process",
        action="store_true",
        help="run the HF baseline in this process, under the malloc settings our CPU engine "
        "made (they speed transformers up too) instead of in a fresh interpreter with the "
        "allocator's defaults, as transformers runs on its own",
    )


def add_results_dir_arg(parser: argparse.ArgumentParser) -> None:
    """`--results-dir DIR`: write the run's result file there (`scripts.bench.results`)."""
    parser.add_argument(
        "--results-dir",
        help="also write one JSON result file into this directory: the command line, date, "
        "machine (CPU model and ISA flags, cores, GPU), torch version, git commit, headline "
        "figures and records; docs/benchmarks.md is rendered from docs/benchmark_results "
        "(python -m scripts.bench.render)",
    )


def add_repeats_arg(parser: argparse.ArgumentParser, unit: str, detail: str = "") -> None:
    """`--repeats N`: every variant built and warmed first, then the variants take turns N
    times and each reports its run of median throughput (`report.median_run`)."""
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help=f"run every {unit} this many times, the variants taking turns{detail}, and report "
        "each variant's run of median throughput: ratios then survive a machine whose speed "
        "drifts",
    )


def check_repeats(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
