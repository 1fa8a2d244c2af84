# SPDX-License-Identifier: Apache-2.0
"""Online serving benchmark over HTTP (SGLang's `bench_serving` layout).

Drives a running server (`--base-url`, or `--host/--port`) or one it launches itself
(`--launch-server`: `python -m runtime.launch_server` on a free loopback port, stopped at
the end) with N requests arriving as a Poisson process (`--request-rate`, `inf` = all at
once), at most `--max-concurrency` in flight, and reports throughput, TTFT, ITL, TPOT and
end-to-end latency, plus the server's speculative accept length.

    python -m runtime.launch_server --model-path CKPT --speculative-algorithm NEXTN &
    python -m scripts.bench_serving --backend sglang --num-prompts 50 --request-rate 4
    python -m scripts.bench_serving --launch-server --model-path CKPT --compare \\
        --backend sglang-oai --num-prompts 32 --max-concurrency 8

Backends: `sglang` (native `/generate`, random prompts sent as `input_ids`), `sglang-oai`
(`/v1/completions`) and `sglang-oai-chat` (`/v1/chat/completions`), both with random text.
Streaming and ignore_eos are on unless `--disable-stream` / `--disable-ignore-eos`.

`--dataset-name multiturn` (native backend): `--num-prompts` conversations of
`--multiturn-turns` turns that all start with one `--multiturn-system-len`-token system
prompt; turn k+1 resends turns 1..k with the server's answers. The result adds the prefix
cache hit rate (the server's `cached_tokens` over prompt tokens) and TTFT of first turns
and of later ones; `--compare-radix-cache` runs every variant with the cache off and on:

    python -m scripts.bench_serving --launch-server --compare --compare-radix-cache \
        --dataset-name multiturn --num-prompts 16 --multiturn-turns 4 \
        --multiturn-system-len 1024 --random-input-len 32 --random-output-len 32

Timing (`scripts.bench.serving_client`): TTFT is the first chunk that carries tokens, ITL
spreads each chunk's gap over the tokens it carried, TPOT = (E2E - TTFT) / (output tokens
- 1).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time

from runtime.engine.tokenizer import load_tokenizer
from scripts.bench import flags
from scripts.bench.datasets import (
    BenchRequest,
    Conversation,
    model_vocab_size,
    multiturn_conversations,
    random_token_ids,
    requests_from_args,
)
from scripts.bench.launched_server import LaunchedServer
from scripts.bench.report import (
    append_jsonl,
    median_run,
    multiturn_metrics,
    print_cache_ratios,
    print_serving_ratios,
    print_serving_result,
    serving_metrics,
)
from scripts.bench.results import command_line, new_result, serving_figures, write_result
from scripts.bench.serving_client import (
    BACKENDS,
    check_reachable,
    flush_cache,
    http_get_json,
    run_conversations,
    run_requests,
    send_request,
    served_model_name,
    server_accept_length,
    server_speculation_choices,
)
from scripts.bench.variants import Variant, build_variants, with_and_without_radix_cache

DEFAULT_PORT = 30000  # launch_server's


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = flags.new_parser("scripts.bench_serving", __doc__)
    flags.add_model_args(p)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="sglang")
    p.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument(
        "--model",
        "--served-model",
        dest="served_model",
        help="model name for the OpenAI backends (default: the first of /v1/models)",
    )
    p.add_argument(
        "--tokenizer", help="tokenizer for random text (default: the server's model path)"
    )
    flags.add_dataset_args(p, num_prompts=50, multiturn=True)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals; inf sends all at once",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument(
        "--extra-request-body", default=None, help="JSON object merged into every request body"
    )
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--output-file", help="append one JSONL record per run")
    flags.add_results_dir_arg(p)
    p.add_argument(
        "--launch-server",
        action="store_true",
        help="start `python -m runtime.launch_server` (one per variant), stop it after",
    )
    p.add_argument("--server-args", default="", help="extra launch_server flags, one string")
    p.add_argument(
        "--compare-radix-cache",
        action="store_true",
        help="run every variant with the prefix cache off, then on, and print on/off ratios",
    )
    p.add_argument(
        "--server-timeout",
        type=float,
        default=3600.0,
        # `--capture-compile startup` compiles every step kind at every bucket before the
        # server answers: a NEXTN server with buckets 1 4 16 64 compiles eight steps of about
        # 150 s each on an empty cache on a 2-core CPU (a server that exits is reported at once)
        help="seconds to wait for a launched server's /health",
    )
    flags.add_repeats_arg(
        p,
        "dataset",
        " (with --launch-server: every variant's server started first, its prefix cache "
        "flushed before each run)",
    )
    args = p.parse_args(argv)
    flags.check_dataset_args(p, args)
    flags.check_repeats(p, args)
    if args.repeats > 1 and not args.launch_server:
        p.error("--repeats needs --launch-server (the servers run side by side)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    if args.compare and not args.launch_server:
        p.error("--compare needs --launch-server (one server per variant)")
    if args.compare_radix_cache and not args.launch_server:
        p.error("--compare-radix-cache needs --launch-server (one server per variant)")
    if args.dataset_name == "multiturn" and args.backend != "sglang":
        p.error("--dataset-name multiturn resends token ids: use --backend sglang")
    return args


def server_vocab_size(info: dict) -> int:
    return info.get("vocab_size") or model_vocab_size(info.get("model_path"), None)


def build_conversations(args, info: dict) -> list[Conversation]:
    vocab = server_vocab_size(info)
    return multiturn_conversations(
        args.seed,
        args.num_prompts,
        args.multiturn_turns,
        args.multiturn_system_len,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        vocab,
    )


def warmup_request(args, info: dict) -> BenchRequest:
    """A multi-turn run warms up with a prompt that shares nothing with the conversations
    (so no variant starts with their system prompt cached)."""
    vocab = server_vocab_size(info)
    ids = random_token_ids(random.Random(args.seed + 1), max(8, args.random_input_len), vocab)
    return BenchRequest(None, ids, len(ids), min(8, args.random_output_len))


def build_dataset(args, info: dict) -> list[BenchRequest]:
    """Seeded prompts, the same for every variant of one invocation: token ids for the
    native backend, text for the OpenAI ones (decoded by the server's tokenizer)."""
    model_path = info.get("tokenizer_path") or info.get("model_path")
    text = args.backend != "sglang"
    tokenizer_path = args.tokenizer or model_path
    tokenizer = None
    if (text and args.dataset_name == "random") or args.tokenizer:
        if not tokenizer_path:
            raise ValueError("random text needs a tokenizer: pass --tokenizer")
        tokenizer = load_tokenizer(tokenizer_path, required=True)
    vocab = None
    if args.dataset_name == "random" and not text:
        # the server reports its vocabulary (its model path is a name, not a local path)
        vocab = info.get("vocab_size") or model_vocab_size(info.get("model_path"), tokenizer)
    return requests_from_args(args, vocab_size=vocab, tokenizer=tokenizer, text=text)


def benchmark(args, base_url: str, variant: Variant | None) -> dict:
    """Warm up, run the dataset against `base_url`, print and record the result."""
    info = http_get_json(base_url, "/get_server_info")
    model = served_model_name(base_url, args.served_model) if args.backend != "sglang" else None
    multiturn = args.dataset_name == "multiturn"
    dataset = build_conversations(args, info) if multiturn else build_dataset(args, info)
    spec = info.get("speculative_algorithm")
    label = (
        variant.label
        if variant
        else (f"{spec}(steps={info.get('speculative_num_steps')})" if spec else "plain")
    )
    print(
        f"\nserver {base_url}: model {info.get('model_path')}, dtype {info.get('dtype')}, "
        f"decoding {label}, {len(dataset)} {'conversations' if multiturn else 'prompts'}, "
        f"backend {args.backend}"
    )
    for _ in range(args.warmup_requests):
        warm = send_request(
            base_url, args, warmup_request(args, info) if multiturn else dataset[0], model
        )
        if not warm.success:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
    if multiturn:
        outputs, duration = run_conversations(base_url, args, dataset, model)
    else:
        outputs, duration = run_requests(base_url, args, dataset, model)
    failed = [o for o in outputs if not o.success]
    if failed:
        print(f"warning: {len(failed)} requests failed, e.g. {failed[0].error}", file=sys.stderr)
    metrics = serving_metrics(outputs, duration)
    if multiturn:
        metrics.update(multiturn_metrics(outputs))
    # cumulative since the server started (SGLang reads it the same way): includes warm-up
    after = http_get_json(base_url, "/get_server_info")
    metrics["accept_length"] = server_accept_length(after)
    metrics.update(server_speculation_choices(after))
    print_serving_result(metrics, args.backend, args.request_rate, args.max_concurrency)
    record = {
        "backend": args.backend,
        "variant": label,
        "dataset_name": args.dataset_name,
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "num_prompts": len(dataset),
        "num_requests": len(outputs),
        "multiturn_turns": args.multiturn_turns if multiturn else None,
        "multiturn_system_len": args.multiturn_system_len if multiturn else None,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "model_path": info.get("model_path"),
        "speculative_algorithm": spec,
        "speculative_num_steps": info.get("speculative_num_steps"),
        "stream": not args.disable_stream,
        "ignore_eos": not args.disable_ignore_eos,
        "threads": args.threads if args.launch_server else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **metrics,
    }
    append_jsonl(args.output_file, record)
    return record


def benchmark_in_turns(args, variants: list[Variant]) -> list[dict]:
    """Every variant's server started (and warm) first, then `--repeats` turns in which
    each runs the dataset once, its prefix cache flushed first; each variant's record is
    its run of median output throughput. An idle server waits on its request queue, so
    the others' runs share the machine with nothing but each other's drift."""
    runs: dict[str, list[dict]] = {v.label: [] for v in variants}
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(LaunchedServer(args, v)) for v in variants]
        for turn in range(args.repeats):
            for variant, server in zip(variants, servers):
                flush_cache(server.base_url)
                record = benchmark(args, server.base_url, variant)
                runs[variant.label].append(record)
                print(
                    f"turn {turn + 1}/{args.repeats} {variant.label}: "
                    f"{record['output_throughput']:.2f} output tok/s in "
                    f"{record['duration']:.2f} s"
                )
    records = []
    for variant in variants:
        records.append(median_run(runs[variant.label], "output_throughput"))
        print(f"{variant.label}: the run of median output throughput")
        print_serving_result(records[-1], args.backend, args.request_rate, args.max_concurrency)
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    try:
        variants = build_variants(args)
        if args.compare_radix_cache:
            variants = with_and_without_radix_cache(variants)
    except ValueError as err:
        print(f"bench_serving: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    records = []
    try:
        if not args.launch_server:
            if args.speculative_algorithm:
                print(
                    "note: speculative flags apply with --launch-server; the running server's "
                    "own settings decide here",
                    file=sys.stderr,
                )
            base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
            check_reachable(base_url)
            records.append(benchmark(args, base_url, None))
            save_result(args, argv, records, [records[0]["variant"]])
            return records
        if args.repeats == 1:
            for variant in variants:
                with LaunchedServer(args, variant) as server:
                    records.append(benchmark(args, server.base_url, variant))
        else:
            records = benchmark_in_turns(args, variants)
    except (RuntimeError, ValueError, OSError) as err:
        print(f"bench_serving: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    print_serving_ratios(records, [v.label for v in variants])
    print_cache_ratios(records, [v.label for v in variants])
    save_result(args, argv, records, [v.label for v in variants])
    return records


def save_result(args, argv: list[str] | None, records: list[dict], labels: list[str]) -> None:
    """The run's result file (`--results-dir`); the machine is this one, where the client
    ran, which is the server's own with --launch-server."""
    if args.results_dir:
        write_result(
            args.results_dir,
            new_result(
                "bench_serving",
                command_line("bench_serving", argv),
                serving_figures(records, labels),
                records,
                device=args.device,
            ),
        )


if __name__ == "__main__":
    main()
