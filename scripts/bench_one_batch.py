# SPDX-License-Identifier: Apache-2.0
"""Static-batch latency through the in-process engine (SGLang's `bench_one_batch` layout).

Every (batch size, input len, output len) combination runs one batch of prompts: random
token ids, or the first input-len tokens of `--dataset-path` prompts. Decoding is greedy with
ignore_eos, so each request makes exactly output-len tokens: the first step is the prefill
(chunked prefill is off, so the whole prompt is one step), every later step a decode step
(one token, or one NEXTN verify round, per request).

    python -m scripts.bench_one_batch --batch-size 1 4 16 --input-len 128 --output-len 64
    python -m scripts.bench_one_batch --compare --batch-size 1 8 --plot one_batch.png
    python -m scripts.bench_one_batch --speculative-algorithm NEXTN --hf-baseline
    python -m scripts.bench_one_batch --profile-overhead --input-len 64 --output-len 64

`--compare` runs plain decoding and NEXTN back to back and prints NEXTN/plain ratios;
`--hf-baseline` runs transformers' `generate` on the same checkpoint, inputs, dtype and
threads and prints ours/HF ratios; `--profile-overhead` measures, at batch 1, the share of
decode wall time spent outside the model forwards and prints a cProfile of the decode loop.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

from runtime.core.errors import InvalidRequestError
from scripts.bench import flags, hf_baseline
from scripts.bench.datasets import WARMUP_OUTPUT_LEN, batch_prompts, tokenized_prompt_file
from scripts.bench.overhead import profile_overhead
from scripts.bench.report import (
    append_jsonl,
    latency_row,
    median_run,
    plot_one_batch,
    print_one_batch_row,
    print_one_batch_summary,
    progress,
    run_config,
)
from scripts.bench.results import command_line, new_result, one_batch_figures, write_result
from scripts.bench.variants import (
    Variant,
    accept_length_between,
    build_variants,
    greedy_params,
    make_engine,
    resolve_model_path,
    set_threads,
    spec_counters,
)
from scripts.bench.warmup import compile_captured_buckets, compiled_since, step_states


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = flags.new_parser("scripts.bench_one_batch", __doc__)
    flags.add_model_args(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, nargs="+", default=[256])
    p.add_argument("--output-len", type=int, nargs="+", default=[32])
    flags.add_cache_args(p, max_total_tokens=False, chunked_prefill=False)
    flags.add_capture_args(p)
    p.add_argument(
        "--dataset-path",
        help='prompt file (JSONL with "prompt", or one per line): each batch takes the first '
        "input-len tokens of prompts at least that long, instead of random token ids",
    )
    p.add_argument(
        "--prefill-repeats",
        type=int,
        default=1,
        help="time each batch's prefill this many times (the measured batch's own prefill, "
        "then fresh prefills of the same prompts with the prefix cache flushed; HF the "
        "same) and report the median: one prefill per batch size is a single timing",
    )
    flags.add_repeats_arg(p, "setting")
    p.add_argument("--run-name", default="default", help="tag stored in the JSONL records")
    p.add_argument("--result-filename", help="append one JSONL record per row")
    flags.add_results_dir_arg(p)
    flags.add_hf_baseline_arg(p)
    p.add_argument(
        "--profile-overhead",
        action="store_true",
        help="at batch 1: share of decode time outside the model forwards + cProfile",
    )
    p.add_argument("--profile-top", type=int, default=15, help="cProfile entries to print")
    p.add_argument("--plot", help="PNG of decode tokens/s and accept length against batch size")
    args = p.parse_args(argv)
    for name in ("batch_size", "input_len"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} values must be >= 1")
    if args.prefill_repeats < 1:
        p.error("--prefill-repeats must be >= 1")
    flags.check_repeats(p, args)
    if min(args.output_len) < 2:
        p.error(
            "--output-len values must be >= 2 (the prefill token plus at least one decode step)"
        )
    return args


def run_batch(engine, prompts: list[list[int]], output_len: int) -> tuple[list, float, list, list]:
    """Prefill the batch in one step, then decode to the end. Returns (requests, prefill
    seconds, per-step seconds, per-step emitted tokens)."""
    reqs = [engine.make_request(ids, greedy_params(output_len)) for ids in prompts]
    for req in reqs:
        engine.add_request(req)
    start = time.perf_counter()
    engine.step()
    prefill = time.perf_counter() - start
    if any(len(r.output_ids) != 1 for r in reqs):
        raise RuntimeError(
            "the prefill did not finish in one step for every request (KV cache or "
            "request slots too small?); lower --batch-size or raise "
            "--max-total-tokens"
        )
    times, tokens = [], []
    produced = len(reqs)
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        now = sum(len(r.output_ids) for r in reqs)  # outside the timed region
        tokens.append(now - produced)
        produced = now
    return reqs, prefill, times, tokens


def time_prefill(engine, prompts: list[list[int]]) -> float:
    """Seconds of one prefill step of `prompts` on an idle engine whose prefix cache holds
    nothing of them (flushed before and after)."""
    engine.flush_cache()
    seconds = run_batch(engine, prompts, 1)[1]
    engine.flush_cache()
    return seconds


def measure_setting(engine, variant: Variant, args, setting: tuple[int, int, int]) -> dict:
    """One row: latency and throughput of one static batch, printed SGLang-style."""
    bs, input_len, output_len = setting
    prompts = batch_prompts(
        args.seed, bs, input_len, engine.model_config.vocab_size, args.file_prompts
    )
    before, retractions = spec_counters(engine), engine.scheduler.num_retractions
    engine.flush_cache()
    steps_before = step_states(engine)
    reqs, prefill, times, tokens = run_batch(engine, prompts, output_len)
    compiled = compiled_since(engine, steps_before)
    if compiled:
        print(
            f"warning: captured steps compiled during this timed run: {', '.join(compiled)}",
            file=sys.stderr,
        )
    accept = accept_length_between(before, spec_counters(engine))
    if args.prefill_repeats > 1:
        repeats = [time_prefill(engine, prompts) for _ in range(args.prefill_repeats - 1)]
        prefill = statistics.median([prefill, *repeats])
    generated = sum(len(r.output_ids) for r in reqs)
    if generated != bs * output_len or any(r.finish_reason.type != "length" for r in reqs):
        raise RuntimeError(
            f"expected {bs * output_len} tokens, got {generated} "
            f"({[r.finish_reason.to_json() for r in reqs if r.finish_reason]})"
        )
    if engine.scheduler.num_retractions != retractions:
        print(
            "warning: requests were retracted during this batch; raise --max-total-tokens",
            file=sys.stderr,
        )
    row = latency_row(
        run_name=args.run_name,
        variant=variant.label,
        backend="engine",
        batch_size=bs,
        input_len=input_len,
        output_len=output_len,
        prefill=prefill,
        decode=sum(times),
        decode_steps=len(times),
        median_step=statistics.median(times),
        median_step_throughput=statistics.median(
            [n / t for n, t in zip(tokens, times, strict=True)]
        ),
        generated=generated,
        accept_length=accept,
    )
    row["output_ids"] = [list(r.output_ids) for r in reqs]
    row["compiled_during_run"] = compiled
    print_one_batch_row(row, times, tokens)
    return row


def engine_for(args, variant: Variant, settings: list[tuple[int, int, int]]):
    """An engine whose pools hold the largest batch at once (no retraction, no chunking)."""
    reserve = 2 * variant.num_steps + 2 * args.page_size  # speculative look-ahead + page rounding
    needed = max(bs * (il + ol + reserve) for bs, il, ol in settings)
    return make_engine(
        args,
        variant,
        chunked_prefill_size=None,
        page_size=args.page_size,
        max_total_tokens=max(flags.DEFAULT_MAX_TOTAL_TOKENS, needed),
        max_running_requests=max(args.max_running_requests, max(args.batch_size)),
    )


def warm_up(engine, args, settings) -> None:
    """A short batch per batch size, then every step kind it ran compiled at each captured
    bucket up to the largest batch size, so first-call costs and compiles stay out of the
    timings; prints what each captured step took to compile."""
    for bs in sorted({s[0] for s in settings}):
        _, input_len, output_len = next(s for s in settings if s[0] == bs)
        warm = batch_prompts(
            args.seed + 1, bs, input_len, engine.model_config.vocab_size, args.file_prompts
        )
        run_batch(engine, warm, min(output_len, WARMUP_OUTPUT_LEN))
    compile_captured_buckets(engine, max(s[0] for s in settings))


def run_variants(args, variants: list[Variant], settings) -> tuple[list, list, dict]:
    """Every setting through one engine per variant; (rows, overhead reports, our greedy
    output ids per setting for the HF comparison). With `--repeats N` every engine is built
    and warmed first, then each setting runs N times with the variants taking turns, and
    each row is the run of median decode throughput: drift of the machine (other tenants,
    clocks) then moves every variant alike instead of whichever ran during it."""
    engines = []
    for variant in variants:
        engine = engine_for(args, variant, settings)
        warm_up(engine, args, settings)
        engines.append(engine)
    runs: dict[tuple[str, tuple], list[dict]] = {}
    for _ in range(args.repeats):
        for setting in progress(settings, args.disable_tqdm, desc="settings"):
            for variant, engine in zip(variants, engines):
                row = measure_setting(engine, variant, args, setting)
                runs.setdefault((variant.label, setting), []).append(row)
    rows, reference = [], {}
    for variant in variants:
        for setting in settings:
            row = median_run(runs[(variant.label, setting)], "decode_throughput")
            reference.setdefault(setting, row["output_ids"])
            rows.append(row)
    overhead = []
    if args.profile_overhead:
        overhead = [profile_overhead(e, v, args) for v, e in zip(variants, engines)]
    return rows, overhead, reference


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        variants = build_variants(args)
        model_path = resolve_model_path(args.model_path)
        args.file_prompts = None
        if args.dataset_path:
            args.file_prompts = tokenized_prompt_file(args.dataset_path, model_path)
            longest = max(len(ids) for ids in args.file_prompts)
            if max(args.input_len) > longest:
                raise ValueError(
                    f"no prompt of --dataset-path has {max(args.input_len)} tokens (the "
                    f"longest has {longest}); lower --input-len"
                )
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"bench_one_batch: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    args.model_path = model_path
    threads = set_threads(args.threads)
    settings = list(itertools.product(args.batch_size, args.input_len, args.output_len))
    config = run_config(args, model_path, threads)
    print(
        f"model: {model_path}, dtype: {args.dtype}, torch threads: {threads}, "
        f"variants: {', '.join(v.label for v in variants)}"
    )
    try:
        rows, overhead, reference = run_variants(args, variants, settings)
        hf_rows = (
            hf_baseline.in_own_process(
                args, hf_baseline.static_batch_rows, model_path, settings, reference
            )
            if args.hf_baseline
            else []
        )
    except (InvalidRequestError, RuntimeError) as err:  # a setting the model cannot run
        print(f"bench_one_batch: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    print_one_batch_summary(rows, [v.label for v in variants], hf_rows)
    for record in rows + hf_rows + overhead:
        append_jsonl(
            args.result_filename,
            {**config, **{k: v for k, v in record.items() if k != "output_ids"}},
        )
    if args.results_dir:
        labels = [v.label for v in variants]
        records = [
            {**config, **{k: v for k, v in r.items() if k != "output_ids"}}
            for r in rows + hf_rows + overhead
        ]
        write_result(
            args.results_dir,
            new_result(
                "bench_one_batch",
                command_line("bench_one_batch", argv),
                one_batch_figures(rows, hf_rows, labels),
                records,
                device=args.device,
            ),
        )
    if args.plot:
        plot_one_batch(args.plot, rows)
    return {"rows": rows, "hf_rows": hf_rows, "overhead": overhead}


if __name__ == "__main__":
    main()
