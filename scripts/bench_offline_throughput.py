# SPDX-License-Identifier: Apache-2.0
"""Offline throughput through the in-process engine (SGLang's `bench_offline_throughput`
layout): N prompts submitted at once, the engine steps until all finish.

    python scripts/bench_offline_throughput.py --num-prompts 64 --random-input-len 256 \\
        --random-output-len 128 --random-range-ratio 0.5
    python scripts/bench_offline_throughput.py --compare --speculative-num-steps 1 2 3 \\
        --plot steps.png
    python scripts/bench_offline_throughput.py --dataset-path prompts.jsonl --hf-baseline

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
import random
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
    block_row,
    build_variants,
    hf_generate,
    load_hf_model,
    make_engine,
    progress,
    random_lengths,
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

WARMUP_PROMPTS, WARMUP_OUTPUT_LEN = 4, 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(p)
    p.add_argument(
        "--dataset-name",
        choices=("random", "file"),
        default=None,
        help="random token ids, or the prompts of --dataset-path (default: file when "
        "--dataset-path is given)",
    )
    p.add_argument(
        "--dataset-path",
        help='JSONL with "prompt" (and optional "output_len"), or one prompt per line',
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument(
        "--random-output-len",
        type=int,
        default=64,
        help="output length of random prompts, and of file prompts without one",
    )
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len * ratio, len] (SGLang); 1.0 = fixed lengths",
    )
    p.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    p.add_argument("--skip-warmup", action="store_true")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=512,
        help="prefill tokens per step, -1 for no chunking (server default 512)",
    )
    p.add_argument("--result-filename", help="append one JSONL record per run")
    p.add_argument(
        "--hf-baseline",
        action="store_true",
        help="also run HF transformers generate and print ours/HF ratios",
    )
    p.add_argument(
        "--hf-batch-sizes",
        type=int,
        nargs="+",
        default=[1, 8, 32, 64],
        help="HF batch sizes to try (the best is kept)",
    )
    p.add_argument("--plot", help="PNG of output tokens/s and accept length against draft steps")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.dataset_name is None:
        args.dataset_name = "file" if args.dataset_path else "random"
    if args.dataset_name == "file" and not args.dataset_path:
        p.error("--dataset-name file needs --dataset-path")
    return args


# --------------------------------------------------------------------------------------
# dataset


def build_dataset(args, engine) -> list[tuple[list[int], int]]:
    """(prompt ids, output len) per request; the same for every variant and for HF."""
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        ins = random_lengths(rng, args.num_prompts, args.random_input_len, args.random_range_ratio)
        outs = random_lengths(
            rng, args.num_prompts, args.random_output_len, args.random_range_ratio
        )
        vocab = engine.model_config.vocab_size
        return [(random_token_ids(rng, n, vocab), m) for n, m in zip(ins, outs, strict=True)]
    if engine.tokenizer is None:
        raise ValueError(f"--dataset-path needs a tokenizer but {engine.model_path} has none")
    records = read_prompt_file(args.dataset_path)[: args.num_prompts]
    return [
        (engine.tokenize(r["prompt"]), r["output_len"] or args.random_output_len) for r in records
    ]


def params(args, output_len: int) -> dict:
    return {
        "temperature": 0,
        "max_new_tokens": output_len,
        "ignore_eos": not args.disable_ignore_eos,
    }


# --------------------------------------------------------------------------------------
# our engine


def run_all(engine, args, dataset, desc: str) -> tuple[list[dict], float]:
    """Submit every request at once and step until all finish; (results, seconds)."""
    reqs = [engine.make_request(ids, params(args, out_len)) for ids, out_len in dataset]
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


def measure(engine, variant: Variant, args, dataset) -> dict:
    """One run of the whole dataset through `engine`; SGLang's result keys."""
    if not args.skip_warmup:
        warm = [(ids, min(out_len, WARMUP_OUTPUT_LEN)) for ids, out_len in dataset[:WARMUP_PROMPTS]]
        run_all(engine, args, warm, "warmup")
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
    input_tokens = sum(r["meta_info"]["prompt_tokens"] for r in ok)
    output_tokens = sum(r["meta_info"]["completion_tokens"] for r in ok)
    return summary(
        "engine",
        variant.label,
        len(ok),
        duration,
        input_tokens,
        output_tokens,
        accept_length_between(before, spec_counters(engine)),
    )


def summary(
    backend: str,
    decoding: str,
    completed: int,
    duration: float,
    input_tokens: int,
    output_tokens: int,
    accept: float | None,
) -> dict:
    return {
        "backend": backend,
        "decoding": decoding,
        "successful_requests": completed,
        "total_latency": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": completed / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "accept_length": accept,
    }


def print_result(r: dict) -> None:
    """SGLang's "Offline Throughput Benchmark Result" block (plus Decoding and Accept length)."""
    print("\n" + block_header("Offline Throughput Benchmark Result"))
    print(block_row("Backend:", r["backend"]))
    print(block_row("Decoding:", r["decoding"]))
    print(block_row("Successful requests:", r["successful_requests"]))
    print(block_row("Benchmark duration (s):", r["total_latency"]))
    print(block_row("Total input tokens:", r["total_input_tokens"]))
    print(block_row("Total generated tokens:", r["total_output_tokens"]))
    print(block_row("Request throughput (req/s):", r["request_throughput"]))
    print(block_row("Input token throughput (tok/s):", r["input_throughput"]))
    print(block_row("Output token throughput (tok/s):", r["output_throughput"]))
    print(block_row("Total token throughput (tok/s):", r["total_throughput"]))
    if r["accept_length"] is not None:
        print(block_row("Accept length:", r["accept_length"]))
    print("=" * 50)


# --------------------------------------------------------------------------------------
# HF baseline


def hf_batches(dataset, batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar lengths (sorted by output then input length),
    which keeps HF's padding and surplus tokens small: the kindest batching for HF."""
    order = sorted(range(len(dataset)), key=lambda i: (dataset[i][1], len(dataset[i][0])))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def hf_run(model, dataset, batch_size: int, disable_tqdm: bool) -> tuple[float, int]:
    """All prompts through `generate` in left-padded batches; (seconds, tokens generated
    including those past a shorter request's own length)."""
    import torch

    generated = 0
    start = time.perf_counter()
    batches = hf_batches(dataset, batch_size)
    for batch in progress(batches, disable_tqdm, desc=f"HF bs={batch_size}"):
        prompts = [dataset[i][0] for i in batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # pad id 0, left
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        new = max(dataset[i][1] for i in batch)
        out, _, _ = hf_generate(model, ids, mask, new)
        generated += out.numel()
    return time.perf_counter() - start, generated


def run_hf_baseline(args, model_path: str, dataset) -> dict:
    """HF transformers on the same prompts, dtype and threads; the best of the batch sizes.
    Throughput counts the tokens requested (as ours does), not HF's padded surplus."""
    if args.disable_ignore_eos:
        print(
            "warning: HF generates every request to its full length (EOS off) while ours may "
            "stop at EOS: drop --disable-ignore-eos for a like-for-like comparison",
            file=sys.stderr,
        )
    dtype = resolve_torch_dtype(model_path, args.dtype)
    model = load_hf_model(model_path, dtype, quiet=args.disable_tqdm)
    sizes = sorted({min(b, len(dataset)) for b in args.hf_batch_sizes if b >= 1})
    hf_run(
        model,
        [(ids, min(n, WARMUP_OUTPUT_LEN)) for ids, n in dataset[:WARMUP_PROMPTS]],
        sizes[0],
        True,
    )
    input_tokens = sum(len(ids) for ids, _ in dataset)
    output_tokens = sum(n for _, n in dataset)
    best = None
    for size in sizes:
        duration, generated = hf_run(model, dataset, size, args.disable_tqdm)
        print(
            f"HF transformers batch size {size}: {duration:.2f} s, "
            f"{output_tokens / duration:.2f} output tok/s ({generated} tokens generated incl. "
            f"{generated - output_tokens} past shorter requests' lengths)"
        )
        if best is None or duration < best[0]:
            best = (duration, size)
    duration, size = best
    result = summary(
        "hf-transformers",
        f"plain (batch size {size})",
        len(dataset),
        duration,
        input_tokens,
        output_tokens,
        None,
    )
    result["hf_batch_size"] = size
    return result


# --------------------------------------------------------------------------------------


def print_ratios(results: list[tuple[Variant, dict]], hf: dict | None) -> None:
    plain = next((r for v, r in results if v.is_plain), None)
    for v, r in results:
        if plain is not None and not v.is_plain:
            print(
                ratio_line(
                    f"{v.label}/plain output token throughput",
                    r["output_throughput"],
                    plain["output_throughput"],
                )
            )
            print(
                ratio_line(
                    f"{v.label}/plain total token throughput",
                    r["total_throughput"],
                    plain["total_throughput"],
                )
            )
    for v, r in results:
        if hf is not None:
            print(
                ratio_line(
                    f"ours[{v.label}]/HF output tok/s",
                    r["output_throughput"],
                    hf["output_throughput"],
                )
            )
            print(
                ratio_line(
                    f"ours[{v.label}]/HF total tok/s", r["total_throughput"], hf["total_throughput"]
                )
            )


def plot(path: str, results: list[tuple[Variant, dict]]) -> None:
    """Output tokens/s and accept length against draft steps (plain at 0 steps)."""
    ordered = sorted(results, key=lambda vr: vr[0].num_steps)
    xs = [v.num_steps for v, _ in ordered]
    series = {"output tokens/s": (xs, [r["output_throughput"] for _, r in ordered])}
    spec = [(v.num_steps, r["accept_length"]) for v, r in ordered if r["accept_length"] is not None]
    accept = {"output tokens/s": ([s for s, _ in spec], [a for _, a in spec])} if spec else {}
    save_plot(path, "draft steps (0 = plain decoding)", series, accept, "output tokens/s")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        variants = build_variants(args)
        model_path = resolve_model_path(args.model_path)
    except (ValueError, FileNotFoundError) as err:
        print(f"bench_offline_throughput: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    args.model_path = model_path
    from runtime.core.errors import InvalidRequestError  # after bench_common's path

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
    results, dataset = [], None
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
        try:
            result = measure(engine, variant, args, dataset)
        except InvalidRequestError as err:  # e.g. a prompt longer than the context
            print(f"bench_offline_throughput: error: {err}", file=sys.stderr)
            raise SystemExit(1) from None
        print_result(result)
        results.append((variant, result))
        append_jsonl(args.result_filename, {**config, **result, "variant": variant.label})
        del engine
    hf = None
    if args.hf_baseline:
        hf = run_hf_baseline(args, model_path, dataset)
        print_result(hf)
        append_jsonl(args.result_filename, {**config, **hf, "variant": "HF"})
    print_ratios(results, hf)
    if args.plot:
        plot(args.plot, results)
    return {"results": [r for _, r in results], "hf": hf, "dataset": dataset}


if __name__ == "__main__":
    main()
