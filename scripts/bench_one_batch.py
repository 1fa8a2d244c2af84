# SPDX-License-Identifier: Apache-2.0
"""Static-batch latency through the in-process engine (SGLang's `bench_one_batch` layout).

Every (batch size, input len, output len) combination runs one batch of prompts: random
token ids, or the first input-len tokens of `--dataset-path` prompts. Decoding is greedy with
ignore_eos, so each request makes exactly output-len tokens: the first step is the prefill
(chunked prefill is off, so the whole prompt is one step), every later step a decode step
(one token, or one NEXTN verify round, per request).

    python scripts/bench_one_batch.py --batch-size 1 4 16 --input-len 128 --output-len 64
    python scripts/bench_one_batch.py --compare --batch-size 1 8 --plot one_batch.png
    python scripts/bench_one_batch.py --speculative-algorithm NEXTN --hf-baseline
    python scripts/bench_one_batch.py --profile-overhead --input-len 64 --output-len 64

`--compare` runs plain decoding and NEXTN back to back and prints NEXTN/plain ratios;
`--hf-baseline` runs transformers' `generate` on the same checkpoint, inputs, dtype and
threads and prints ours/HF ratios; `--profile-overhead` measures, at batch 1, the share of
decode wall time spent outside the model forwards and prints a cProfile of the decode loop.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    Variant,
    accept_length_between,
    add_model_args,
    append_jsonl,
    block_header,
    build_variants,
    hf_generate,
    load_hf_model,
    make_engine,
    print_table,
    progress,
    random_token_ids,
    ratio_line,
    read_prompt_file,
    resolve_model_path,
    resolve_torch_dtype,
    run_config,
    save_plot,
    set_threads,
    spec_counters,
)

PRINTED_DECODE_STEPS = 5  # like SGLang, print the first few decode steps one by one
WARMUP_OUTPUT_LEN = 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, nargs="+", default=[256])
    p.add_argument("--output-len", type=int, nargs="+", default=[32])
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument(
        "--dataset-path",
        help='prompt file (JSONL with "prompt", or one per line): each batch takes the first '
        "input-len tokens of prompts at least that long, instead of random token ids",
    )
    p.add_argument("--run-name", default="default", help="tag stored in the JSONL records")
    p.add_argument("--result-filename", help="append one JSONL record per row")
    p.add_argument(
        "--hf-baseline",
        action="store_true",
        help="also run HF transformers generate and print ours/HF ratios",
    )
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
    if min(args.output_len) < 2:
        p.error(
            "--output-len values must be >= 2 (the prefill token plus at least one decode step)"
        )
    return args


def settings_of(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    return list(itertools.product(args.batch_size, args.input_len, args.output_len))


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


def tokenized_prompt_file(path: str, model_path: str) -> list[list[int]]:
    """Token ids of each prompt of `path`, by the checkpoint's tokenizer (no special tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in read_prompt_file(path)]


def greedy(output_len: int) -> dict:
    return {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}


# --------------------------------------------------------------------------------------
# our engine


def run_batch(engine, prompts: list[list[int]], output_len: int) -> tuple[list, float, list, list]:
    """Prefill the batch in one step, then decode to the end. Returns (requests, prefill
    seconds, per-step seconds, per-step emitted tokens)."""
    reqs = [engine.make_request(ids, greedy(output_len)) for ids in prompts]
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


def measure_setting(engine, variant: Variant, args, setting: tuple[int, int, int]) -> dict:
    """One row: latency and throughput of one static batch, printed SGLang-style."""
    bs, input_len, output_len = setting
    prompts = batch_prompts(
        args.seed, bs, input_len, engine.model_config.vocab_size, args.file_prompts
    )
    before, retractions = spec_counters(engine), engine.scheduler.num_retractions
    reqs, prefill, times, tokens = run_batch(engine, prompts, output_len)
    accept = accept_length_between(before, spec_counters(engine))
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
    decode = sum(times)
    decode_tokens = bs * (output_len - 1)
    step_tput = [n / t for n, t in zip(tokens, times, strict=True)]
    row = {
        "run_name": args.run_name,
        "variant": variant.label,
        "backend": "engine",
        "batch_size": bs,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency": prefill,
        "prefill_throughput": bs * input_len / prefill,
        "decode_steps": len(times),
        "median_decode_latency": statistics.median(times),
        "median_decode_throughput": statistics.median(step_tput),
        "decode_latency_per_token": decode / (output_len - 1),
        "decode_throughput": decode_tokens / decode,
        "total_latency": prefill + decode,
        "overall_throughput": bs * (input_len + output_len) / (prefill + decode),
        "generated_tokens": generated,
        "accept_length": accept,
        "output_ids": [list(r.output_ids) for r in reqs],
    }
    print_sglang_lines(row, times, tokens)
    return row


def print_sglang_lines(row: dict, times: list[float], tokens: list[int]) -> None:
    """SGLang's `bench_one_batch` lines, plus the per-token and accept-length line."""
    print(
        f"\n[{row['variant']}] batch size {row['batch_size']}, input len {row['input_len']}, "
        f"output len {row['output_len']}"
    )
    print(
        f"Prefill. latency: {row['prefill_latency']:6.5f} s, "
        f"throughput: {row['prefill_throughput']:9.2f} token/s"
    )
    for i, (t, n) in enumerate(zip(times[:PRINTED_DECODE_STEPS], tokens, strict=False)):
        print(
            f"Decode {i}. Batch size: {row['batch_size']}, latency: {t:6.5f} s, "
            f"throughput: {n / t:9.2f} token/s"
        )
    print(
        f"Decode.  median latency: {row['median_decode_latency']:6.5f} s, "
        f"median throughput: {row['median_decode_throughput']:9.2f} token/s"
    )
    accept = row["accept_length"]
    print(
        f"Decode.  per output token: {row['decode_latency_per_token'] * 1000:8.3f} ms, "
        f"throughput: {row['decode_throughput']:9.2f} token/s, "
        f"accept length: {'n/a' if accept is None else f'{accept:.2f}'}"
    )
    print(
        f"Total. latency: {row['total_latency']:6.3f} s, "
        f"throughput: {row['overall_throughput']:9.2f} token/s"
    )


def warm_up(engine, args, setting: tuple[int, int, int]) -> None:
    """One short batch of the first setting, so first-call costs stay out of the timings."""
    bs, input_len, output_len = setting
    prompts = batch_prompts(
        args.seed + 1, bs, input_len, engine.model_config.vocab_size, args.file_prompts
    )
    run_batch(engine, prompts, min(output_len, WARMUP_OUTPUT_LEN))


def engine_for(args, variant: Variant, settings: list[tuple[int, int, int]]):
    """An engine whose pools hold the largest batch at once (no retraction, no chunking)."""
    reserve = 2 * variant.num_steps + 2 * args.page_size  # speculative look-ahead + page rounding
    needed = max(bs * (il + ol + reserve) for bs, il, ol in settings)
    return make_engine(
        args,
        variant,
        chunked_prefill_size=None,
        page_size=args.page_size,
        max_total_tokens=max(65536, needed),
        max_running_requests=max(args.max_running_requests, max(args.batch_size)),
    )


# --------------------------------------------------------------------------------------
# engine overhead


class ForwardTimer:
    """Wraps a runner's `forward` and `build_context` (instance attributes shadow the class
    methods, so the workers call the wrappers) and sums their wall time."""

    def __init__(self, runner):
        self.runner, self.forward_s, self.context_s = runner, 0.0, 0.0
        forward = runner.forward
        build = getattr(runner, "build_context", None)  # optional: only splits the report

        def timed_forward(inp):
            start = time.perf_counter()
            try:
                return forward(inp)
            finally:
                self.forward_s += time.perf_counter() - start

        def timed_build(inp):
            start = time.perf_counter()
            try:
                return build(inp)
            finally:
                self.context_s += time.perf_counter() - start

        runner.forward = timed_forward
        if build is not None:
            runner.build_context = timed_build

    def reset(self) -> None:
        self.forward_s = self.context_s = 0.0

    def remove(self) -> None:
        for name in ("forward", "build_context"):
            self.runner.__dict__.pop(name, None)  # the class methods show through again


def profile_overhead(engine, variant: Variant, args) -> dict:
    """Batch 1: decode wall time vs time inside the target (and draft) forwards, then a
    cProfile of a second decode loop (separate, so profiling cost does not skew the share)."""
    input_len, output_len = args.input_len[0], max(args.output_len)
    prompts = batch_prompts(
        args.seed + 2, 1, input_len, engine.model_config.vocab_size, args.file_prompts
    )
    timers = {"target": ForwardTimer(engine.runner)}
    if variant.spec:
        timers["draft"] = ForwardTimer(engine.worker.drafter.runner)
    try:
        reqs = [engine.make_request(prompts[0], greedy(output_len))]
        engine.add_request(reqs[0])
        engine.step()  # prefill, not part of the decode share
        for t in timers.values():
            t.reset()
        start = time.perf_counter()
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        wall = time.perf_counter() - start
    finally:
        for t in timers.values():
            t.remove()
    inside = sum(t.forward_s for t in timers.values())
    context = sum(t.context_s for t in timers.values())
    report = {
        "run_name": args.run_name,
        "variant": variant.label,
        "kind": "overhead",
        "batch_size": 1,
        "input_len": input_len,
        "output_len": output_len,
        "decode_wall_s": wall,
        "decode_steps": steps,
        "forward_share": {k: t.forward_s / wall for k, t in timers.items()},
        "context_build_share": context / wall,
        "engine_overhead_share": (wall - inside) / wall,
    }
    print("\n" + block_header(f"Engine overhead [{variant.label}]"))
    print(
        f"batch 1, input len {input_len}, output len {output_len}: decode wall time "
        f"{wall * 1000:.1f} ms over {steps} steps ({wall / steps * 1000:.2f} ms/step)"
    )
    for name, share in report["forward_share"].items():
        print(f"{name} runner forward: {share * 100:.1f}% of decode wall time")
    print(f"  (ForwardContext.build inside those forwards: {context / wall * 100:.1f}%)")
    print(
        f"engine overhead: {report['engine_overhead_share'] * 100:.1f}% of decode wall time "
        "(scheduling, sampling, bookkeeping, detokenizing)"
    )
    print_decode_profile(engine, prompts[0], output_len, args.profile_top)
    return report


def print_decode_profile(engine, prompt: list[int], output_len: int, top: int) -> None:
    """cProfile of one batch-1 decode loop, top entries by cumulative time."""
    req = engine.make_request(prompt, greedy(output_len))
    engine.add_request(req)
    engine.step()
    profiler = cProfile.Profile()
    profiler.enable()
    while engine.has_work():
        engine.step()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
    print(f"cProfile of the decode loop (top {top} by cumulative time):")
    text = out.getvalue().strip().splitlines()
    start = next((i for i, line in enumerate(text) if "ncalls" in line), 0)
    print("\n".join(text[start:]))


# --------------------------------------------------------------------------------------
# HF baseline


def run_hf_baseline(args, model_path: str, settings, reference: dict) -> list[dict]:
    """transformers `generate` on the same prompts, dtype and threads; `reference` maps a
    setting to our greedy output ids, to report whether HF produced the same tokens."""
    import torch

    dtype = resolve_torch_dtype(model_path, args.dtype)
    model = load_hf_model(model_path, dtype, quiet=args.disable_tqdm)
    vocab = model.config.vocab_size
    bs, il, ol = settings[0]
    warm = torch.tensor(batch_prompts(args.seed + 1, bs, il, vocab, args.file_prompts))
    hf_generate(model, warm, torch.ones_like(warm), min(ol, WARMUP_OUTPUT_LEN))
    rows = []
    for bs, il, ol in progress(settings, args.disable_tqdm, desc="HF baseline"):
        ids = torch.tensor(batch_prompts(args.seed, bs, il, vocab, args.file_prompts))
        out, clock, start = hf_generate(model, ids, torch.ones_like(ids), ol)
        prefill = clock.times[1] - start
        decode = clock.times[-1] - clock.times[1]
        arrivals = clock.times[1:-1]  # one per new token (the last entry is the end)
        step_times = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        mine = reference.get((bs, il, ol), [])
        same = sum(o == r for o, r in zip(out.tolist(), mine, strict=False))
        median_step = statistics.median(step_times) if step_times else decode
        row = {
            "run_name": args.run_name,
            "variant": "HF",
            "backend": "hf-transformers",
            "batch_size": bs,
            "input_len": il,
            "output_len": ol,
            "prefill_latency": prefill,
            "prefill_throughput": bs * il / prefill,
            "decode_steps": ol - 1,
            "median_decode_latency": median_step,
            "median_decode_throughput": bs / median_step,
            "decode_latency_per_token": decode / (ol - 1),
            "decode_throughput": bs * (ol - 1) / decode,
            "total_latency": prefill + decode,
            "overall_throughput": bs * (il + ol) / (prefill + decode),
            "generated_tokens": out.numel(),
            "accept_length": None,
            "same_greedy_tokens_as_ours": f"{same}/{bs}",
        }
        print(
            f"\n[HF transformers] batch size {bs}, input len {il}, output len {ol} "
            f"(greedy outputs identical to ours: {same}/{bs} rows)"
        )
        print(
            f"Prefill. latency: {prefill:6.5f} s, "
            f"throughput: {row['prefill_throughput']:9.2f} token/s"
        )
        print(
            f"Decode.  per output token: {row['decode_latency_per_token'] * 1000:8.3f} ms, "
            f"throughput: {row['decode_throughput']:9.2f} token/s"
        )
        print(
            f"Total. latency: {row['total_latency']:6.3f} s, "
            f"throughput: {row['overall_throughput']:9.2f} token/s"
        )
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------
# summary


def print_summary(rows: list[dict], variants: list[Variant], hf_rows: list[dict]) -> None:
    """The final table, then NEXTN/plain and ours/HF ratios per setting."""
    print("\n" + block_header("One Batch Benchmark Result"))
    columns = [
        "variant",
        "batch",
        "input",
        "output",
        "prefill (ms)",
        "decode step (ms, median)",
        "ms/token",
        "decode tok/s",
        "overall tok/s",
        "accept len",
    ]
    print_table(
        columns,
        [
            [
                r["variant"],
                r["batch_size"],
                r["input_len"],
                r["output_len"],
                r["prefill_latency"] * 1000,
                r["median_decode_latency"] * 1000,
                r["decode_latency_per_token"] * 1000,
                r["decode_throughput"],
                r["overall_throughput"],
                r["accept_length"],
            ]
            for r in rows + hf_rows
        ],
    )
    by_key = {
        (r["variant"], r["batch_size"], r["input_len"], r["output_len"]): r for r in rows + hf_rows
    }
    keys = sorted({(r["batch_size"], r["input_len"], r["output_len"]) for r in rows})
    for bs, il, ol in keys:
        tag = f"[bs={bs} in={il} out={ol}]"
        plain = by_key.get(("plain", bs, il, ol))
        hf = by_key.get(("HF", bs, il, ol))
        for v in variants:
            ours = by_key[(v.label, bs, il, ol)]
            if plain is not None and not v.is_plain:
                print(
                    ratio_line(
                        f"{v.label}/plain decode tok/s {tag}",
                        ours["decode_throughput"],
                        plain["decode_throughput"],
                    )
                )
                print(
                    ratio_line(
                        f"{v.label}/plain overall tok/s {tag}",
                        ours["overall_throughput"],
                        plain["overall_throughput"],
                    )
                )
            if hf is not None:
                for what in ("decode", "overall", "prefill"):
                    print(
                        ratio_line(
                            f"ours[{v.label}]/HF {what} tok/s {tag}",
                            ours[f"{what}_throughput"],
                            hf[f"{what}_throughput"],
                        )
                    )


def plot(path: str, rows: list[dict]) -> None:
    series, accept = {}, {}
    for r in sorted(rows, key=lambda r: r["batch_size"]):
        name = f"{r['variant']} in={r['input_len']} out={r['output_len']}"
        xs, ys = series.setdefault(name, ([], []))
        xs.append(r["batch_size"])
        ys.append(r["decode_throughput"])
        if r["accept_length"] is not None:
            ax, ay = accept.setdefault(name, ([], []))
            ax.append(r["batch_size"])
            ay.append(r["accept_length"])
    save_plot(path, "batch size", series, accept, "decode tokens/s", log_x=True)


def run_variants(args, variants: list[Variant], settings) -> tuple[list, list, dict]:
    """Every setting through one engine per variant; (rows, overhead reports, our greedy
    output ids per setting for the HF comparison)."""
    rows, overhead, reference = [], [], {}
    for variant in variants:
        engine = engine_for(args, variant, settings)
        warm_up(engine, args, settings[0])
        for setting in progress(settings, args.disable_tqdm, desc=variant.label):
            row = measure_setting(engine, variant, args, setting)
            reference.setdefault(setting, row["output_ids"])
            rows.append(row)
        if args.profile_overhead:
            overhead.append(profile_overhead(engine, variant, args))
        del engine
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
    from runtime.core.errors import InvalidRequestError  # after bench_common's path

    threads = set_threads(args.threads)
    settings = settings_of(args)
    config = run_config(args, model_path, threads)
    print(
        f"model: {model_path}, dtype: {args.dtype}, torch threads: {threads}, "
        f"variants: {', '.join(v.label for v in variants)}"
    )
    try:
        rows, overhead, reference = run_variants(args, variants, settings)
        hf_rows = run_hf_baseline(args, model_path, settings, reference) if args.hf_baseline else []
    except (InvalidRequestError, RuntimeError) as err:  # a setting the model cannot run
        print(f"bench_one_batch: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    print_summary(rows, variants, hf_rows)
    for record in rows + hf_rows + overhead:
        append_jsonl(
            args.result_filename,
            {**config, **{k: v for k, v in record.items() if k != "output_ids"}},
        )
    if args.plot:
        plot(args.plot, rows)
    return {"rows": rows, "hf_rows": hf_rows, "overhead": overhead}


if __name__ == "__main__":
    main()
