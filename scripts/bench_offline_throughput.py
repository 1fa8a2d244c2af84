# SPDX-License-Identifier: Apache-2.0
"""Offline throughput through the in-process engine (SGLang's `bench_offline_throughput`
layout): N prompts submitted at once, the engine steps until all finish.

    python -m scripts.bench_offline_throughput --num-prompts 64 --random-input-len 256 \\
        --random-output-len 128 --random-range-ratio 0.5
    python -m scripts.bench_offline_throughput --compare --speculative-num-steps 1 2 3 \\
        --plot steps.png
    python -m scripts.bench_offline_throughput --dataset-path prompts.jsonl --hf-baseline

Prompts are random token ids (`--dataset-name random`) or a file (`--dataset-path`: JSONL
objects with "prompt", optional "output_len", or one prompt per line; tokenized with the
checkpoint's tokenizer). Requests are greedy with ignore_eos (unless
`--disable-ignore-eos`), so the generated token count is fixed by the dataset.
`--compare` runs plain decoding and NEXTN (one run per `--speculative-num-steps` value) on
the same prompts; `--hf-baseline` runs transformers' `generate` (left-padded batches of each
`--hf-batch-sizes` value, keeping HF's best) and prints ours/HF ratios.
"""

from __future__ import annotations

import argparse
import sys
import time

from runtime.core.errors import InvalidRequestError
from scripts.bench import flags, hf_baseline
from scripts.bench.datasets import requests_from_args, warmup_subset
from scripts.bench.report import (
    append_jsonl,
    median_run,
    plot_offline,
    print_offline_ratios,
    print_offline_result,
    progress,
    run_config,
    throughput_summary,
)
from scripts.bench.results import command_line, new_result, offline_figures, write_result
from scripts.bench.variants import (
    Variant,
    accept_length_between,
    build_variants,
    greedy_params,
    make_engine,
    plain_share_between,
    resolve_model_path,
    set_threads,
    spec_counters,
)
from scripts.bench.warmup import compile_captured_buckets


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = flags.new_parser("scripts.bench_offline_throughput", __doc__)
    flags.add_model_args(p)
    flags.add_dataset_args(p, num_prompts=64)
    p.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--skip-warmup", action="store_true")
    flags.add_cache_args(p)
    flags.add_capture_args(p)
    p.add_argument("--result-filename", help="append one JSONL record per run")
    flags.add_results_dir_arg(p)
    flags.add_hf_baseline_arg(p)
    p.add_argument(
        "--hf-batch-sizes",
        type=int,
        nargs="+",
        default=[1, 8, 32, 64],
        help="HF batch sizes to try (the best is kept)",
    )
    p.add_argument("--plot", help="PNG of output tokens/s and accept length against draft steps")
    flags.add_repeats_arg(p, "dataset", " (every engine built and warmed first)")
    args = p.parse_args(argv)
    flags.check_dataset_args(p, args)
    flags.check_repeats(p, args)
    return args


def build_dataset(args, engine) -> list[tuple[list[int], int]]:
    """(prompt ids, output len) per request; the same for every variant and for HF. File
    prompts are tokenized as the engine tokenizes a text request."""
    if args.dataset_name == "random":
        vocab = engine.model_config.vocab_size
        return [(r.input_ids, r.output_len) for r in requests_from_args(args, vocab_size=vocab)]
    if engine.tokenizer is None:
        raise ValueError(f"--dataset-path needs a tokenizer but {engine.model_path} has none")
    return [(engine.tokenize(r.prompt), r.output_len) for r in requests_from_args(args)]


def run_all(engine, args, dataset, desc: str) -> tuple[list[dict], float]:
    """Submit every request at once and step until all finish; (results, seconds)."""
    ignore_eos = not args.disable_ignore_eos
    reqs = [engine.make_request(ids, greedy_params(n, ignore_eos)) for ids, n in dataset]
    bar = progress(total=len(reqs), disable=args.disable_tqdm, desc=desc)
    start = time.perf_counter()
    for req in reqs:
        engine.add_request(req)
    done = 0
    while engine.has_work():
        engine.step()
        finished = sum(r.finished for r in reqs)
        bar.update(finished - done)
        done = finished
    duration = time.perf_counter() - start
    bar.close()
    return [engine.result(r) for r in reqs], duration


def warm_up(engine, args, dataset) -> None:
    """A few of the prompts through `engine`, then every captured bucket the run can meet
    compiled; the prefix cache is flushed so the timed run cannot reuse the warm-up."""
    if not args.skip_warmup:
        run_all(engine, args, warmup_subset(dataset), "warmup")
        compile_captured_buckets(engine, min(len(dataset), engine.config.max_running_requests))
        engine.flush_cache()


def measure(engine, variant: Variant, args, dataset) -> dict:
    """One run of the whole dataset through `engine` (warmed up, its prefix cache empty);
    SGLang's result keys."""
    before = spec_counters(engine)
    results, duration = run_all(engine, args, dataset, variant.label)
    ok = [r for r in results if r["meta_info"]["finish_reason"]["type"] != "abort"]
    if len(ok) != len(results):
        failed = next(r for r in results if r not in ok)
        print(
            f"warning: {len(results) - len(ok)} requests failed, e.g. "
            f"{failed['meta_info']['finish_reason']}",
            file=sys.stderr,
        )
    after = spec_counters(engine)
    summary = throughput_summary(
        "engine",
        variant.label,
        len(ok),
        duration,
        sum(r["meta_info"]["prompt_tokens"] for r in ok),
        sum(r["meta_info"]["completion_tokens"] for r in ok),
        accept_length_between(before, after),
    )
    if variant.spec:
        summary["plain_decode_share"] = plain_share_between(before, after)
    return summary


def run_variants(args, variants: list[Variant]) -> tuple[list[tuple[Variant, dict]], list]:
    """Each variant's result over the dataset, and the dataset. One run each, one engine
    at a time; with `--repeats N` every engine is built and warmed first, then the variants
    take turns N times and each keeps its run of median throughput, so drift of the machine
    moves every variant alike instead of whichever ran during it."""
    engines, dataset = [], None
    runs: dict[str, list[dict]] = {v.label: [] for v in variants}
    for variant in variants:
        engine = make_engine(
            args,
            variant,
            page_size=args.page_size,
            max_total_tokens=args.max_total_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
        )
        if dataset is None:
            try:
                dataset = build_dataset(args, engine)
            except ValueError as err:
                print(f"bench_offline_throughput: error: {err}", file=sys.stderr)
                raise SystemExit(2) from None
        warm_up(engine, args, dataset)
        if args.repeats > 1:
            engines.append(engine)
        else:  # one run now, one engine in memory at a time
            runs[variant.label].append(measure_or_exit(engine, variant, args, dataset))
            print_offline_result(runs[variant.label][-1])
            del engine
    for turn in range(args.repeats if engines else 0):
        for variant, engine in zip(variants, engines):
            result = measure_or_exit(engine, variant, args, dataset)
            engine.flush_cache()  # the next turn prefills every prompt again
            runs[variant.label].append(result)
            print(
                f"turn {turn + 1}/{args.repeats} {variant.label}: "
                f"{result['output_throughput']:.2f} output tok/s in {result['total_latency']:.2f} s"
            )
    results = []
    for variant in variants:
        result = median_run(runs[variant.label], "output_throughput")
        if engines:
            print_offline_result(result)
        results.append((variant, result))
    return results, dataset


def measure_or_exit(engine, variant: Variant, args, dataset) -> dict:
    try:
        return measure(engine, variant, args, dataset)
    except InvalidRequestError as err:  # e.g. a prompt longer than the context
        print(f"bench_offline_throughput: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        variants = build_variants(args)
        model_path = resolve_model_path(args.model_path)
    except (ValueError, FileNotFoundError) as err:
        print(f"bench_offline_throughput: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    args.model_path = model_path
    threads = set_threads(args.threads)
    config = {
        **run_config(args, model_path, threads),
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
    }
    print(
        f"model: {model_path}, dtype: {args.dtype}, torch threads: {threads}, "
        f"variants: {', '.join(v.label for v in variants)}"
    )
    measured, dataset = run_variants(args, variants)
    for variant, result in measured:
        append_jsonl(args.result_filename, {**config, **result, "variant": variant.label})
    hf = None
    if args.hf_baseline:
        hf = hf_baseline.in_own_process(
            args, hf_baseline.best_dataset_throughput, model_path, dataset
        )
        print_offline_result(hf)
        append_jsonl(args.result_filename, {**config, **hf, "variant": "HF"})
    labelled = [(v.label, r) for v, r in measured]
    print_offline_ratios(labelled, hf)
    if args.results_dir:
        records = [{**config, **r, "variant": label} for label, r in labelled]
        records += [{**config, **hf, "variant": "HF"}] if hf is not None else []
        write_result(
            args.results_dir,
            new_result(
                "bench_offline_throughput",
                command_line("bench_offline_throughput", argv),
                offline_figures(labelled, hf),
                records,
                device=args.device,
            ),
        )
    if args.plot:
        plot_offline(args.plot, [(v.num_steps, r) for v, r in measured])
    return {"results": [r for _, r in measured], "hf": hf, "dataset": dataset}


if __name__ == "__main__":
    main()
