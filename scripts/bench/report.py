# SPDX-License-Identifier: Apache-2.0
"""How the benchmarks report: SGLang's printed result blocks and lines, markdown tables,
clearly labelled ratios of two figures measured in the same run, the JSONL records, latency
percentiles and plots. Every printed figure is computed here from the records the scripts
return, so the printed text, the JSONL and the return values always agree."""

from __future__ import annotations

import argparse
import json
import sys
import time

BLOCK_WIDTH = 50  # SGLang's result blocks are 50 columns wide


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


def plain_share(plain: int, emitted: int) -> float | None:
    """The share of decoded tokens from NEXTN steps that did not speculate (`plain` of
    them, `emitted` by verify rounds), rounded for the report; None when none were decoded."""
    return round(plain / (plain + emitted), 3) if plain + emitted else None


def median_run(runs: list[dict], key: str) -> dict:
    """The run of median `key` (`--repeats`; the lower middle one of an even count)."""
    return sorted(runs, key=lambda run: run[key])[(len(runs) - 1) // 2]


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
# bench_one_batch

PRINTED_DECODE_STEPS = 5  # like SGLang, print the first few decode steps one by one


def latency_row(
    *,
    run_name: str,
    variant: str,
    backend: str,
    batch_size: int,
    input_len: int,
    output_len: int,
    prefill: float,
    decode: float,
    decode_steps: int,
    median_step: float,
    median_step_throughput: float,
    generated: int,
    accept_length: float | None,
) -> dict:
    """One static batch's record: the prefill made one token per request, the decode steps
    the other `output_len - 1`."""
    return {
        "run_name": run_name,
        "variant": variant,
        "backend": backend,
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency": prefill,
        "prefill_throughput": batch_size * input_len / prefill,
        "decode_steps": decode_steps,
        "median_decode_latency": median_step,
        "median_decode_throughput": median_step_throughput,
        "decode_latency_per_token": decode / (output_len - 1),
        "decode_throughput": batch_size * (output_len - 1) / decode,
        "total_latency": prefill + decode,
        "overall_throughput": batch_size * (input_len + output_len) / (prefill + decode),
        "generated_tokens": generated,
        "accept_length": accept_length,
    }


def print_one_batch_row(row: dict, times: list[float], tokens: list[int]) -> None:
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
    if times:
        # one step far above the median (a compile, a stall) shows here, not in the median
        slowest = max(range(len(times)), key=times.__getitem__)
        print(
            f"Decode.  slowest step: {times[slowest]:6.5f} s (step {slowest} of {len(times)}, "
            f"{tokens[slowest]} tokens)"
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


def print_hf_batch_row(row: dict) -> None:
    """The HF baseline's lines for one static batch."""
    bs = row["batch_size"]
    print(
        f"\n[HF transformers] batch size {bs}, input len {row['input_len']}, output len "
        f"{row['output_len']} (greedy outputs identical to ours: "
        f"{row['same_greedy_tokens_as_ours']} rows)"
    )
    print(
        f"Prefill. latency: {row['prefill_latency']:6.5f} s, "
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


def print_one_batch_summary(rows: list[dict], labels: list[str], hf_rows: list[dict]) -> None:
    """The final table, then NEXTN/plain and ours/HF ratios per setting (`labels`: the
    variants in run order, plain first when it ran)."""
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
        for label in labels:
            ours = by_key[(label, bs, il, ol)]
            if plain is not None and label != "plain":
                print(
                    ratio_line(
                        f"{label}/plain decode tok/s {tag}",
                        ours["decode_throughput"],
                        plain["decode_throughput"],
                    )
                )
                print(
                    ratio_line(
                        f"{label}/plain overall tok/s {tag}",
                        ours["overall_throughput"],
                        plain["overall_throughput"],
                    )
                )
            if hf is not None:
                for what in ("decode", "overall", "prefill"):
                    print(
                        ratio_line(
                            f"ours[{label}]/HF {what} tok/s {tag}",
                            ours[f"{what}_throughput"],
                            hf[f"{what}_throughput"],
                        )
                    )


def plot_one_batch(path: str, rows: list[dict]) -> None:
    """Decode tokens/s and accept length against batch size, one line per variant/shape."""
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


# --------------------------------------------------------------------------------------
# bench_offline_throughput


def throughput_summary(
    backend: str,
    decoding: str,
    completed: int,
    duration: float,
    input_tokens: int,
    output_tokens: int,
    accept: float | None,
) -> dict:
    """SGLang's offline result keys for one run over a whole dataset."""
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


def print_offline_result(r: dict) -> None:
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
    if r.get("plain_decode_share") is not None:
        print(block_row("Tokens decoded plainly:", r["plain_decode_share"]))
    print("=" * BLOCK_WIDTH)


def print_offline_ratios(results: list[tuple[str, dict]], hf: dict | None) -> None:
    """NEXTN/plain and ours/HF throughput ratios; `results` are (variant label, result)."""
    plain = next((r for label, r in results if label == "plain"), None)
    for label, r in results:
        if plain is not None and label != "plain":
            print(
                ratio_line(
                    f"{label}/plain output token throughput",
                    r["output_throughput"],
                    plain["output_throughput"],
                )
            )
            print(
                ratio_line(
                    f"{label}/plain total token throughput",
                    r["total_throughput"],
                    plain["total_throughput"],
                )
            )
    for label, r in results:
        if hf is not None:
            print(
                ratio_line(
                    f"ours[{label}]/HF output tok/s",
                    r["output_throughput"],
                    hf["output_throughput"],
                )
            )
            print(
                ratio_line(
                    f"ours[{label}]/HF total tok/s", r["total_throughput"], hf["total_throughput"]
                )
            )


def plot_offline(path: str, results: list[tuple[int, dict]]) -> None:
    """Output tokens/s and accept length against draft steps (`results`: (steps, result),
    plain at 0 steps)."""
    ordered = sorted(results, key=lambda sr: sr[0])
    xs = [steps for steps, _ in ordered]
    series = {"output tokens/s": (xs, [r["output_throughput"] for _, r in ordered])}
    spec = [(s, r["accept_length"]) for s, r in ordered if r["accept_length"] is not None]
    accept = {"output tokens/s": ([s for s, _ in spec], [a for _, a in spec])} if spec else {}
    save_plot(path, "draft steps (0 = plain decoding)", series, accept, "output tokens/s")


# --------------------------------------------------------------------------------------
# bench_serving


def serving_metrics(outputs: list, duration: float) -> dict:
    """SGLang's serving metrics (times in ms) of request outputs (`success`, `latency`,
    `ttft`, `itl`, `prompt_len`, `output_len`)."""
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_len for o in ok)
    e2e = percentiles([o.latency for o in ok])
    ttft = percentiles([o.ttft for o in ok])
    itl = percentiles([x for o in ok for x in o.itl])
    tpot = percentiles([(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1])
    metrics = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
        "concurrency": sum(o.latency for o in ok) / duration,
    }
    for name, stats in (("e2e_latency", e2e), ("ttft", ttft), ("itl", itl), ("tpot", tpot)):
        for key, value in stats.items():
            metrics[f"{key}_{name}_ms"] = value
    return metrics


def multiturn_metrics(outputs: list) -> dict:
    """Prefix-cache figures of a multi-turn run: the fraction of prompt tokens the server's
    cache served, and TTFT of first turns apart from later ones (which resend the earlier)."""
    ok = [o for o in outputs if o.success]
    prompt = sum(o.prompt_len for o in ok)
    metrics = {"cache_hit_rate": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0}
    for name, turns in (
        ("turn1", [o for o in ok if o.turn == 0]),
        ("turn2plus", [o for o in ok if o.turn > 0]),
    ):
        for key, value in percentiles([o.ttft for o in turns]).items():
            metrics[f"{key}_ttft_{name}_ms"] = value
    return metrics


def print_serving_result(
    m: dict, backend: str, request_rate: float, max_concurrency: int | None
) -> None:
    """SGLang's "Serving Benchmark Result" block."""
    print("\n" + block_header("Serving Benchmark Result"))
    print(block_row("Backend:", backend))
    print(
        block_row("Traffic request rate:", "inf" if request_rate == float("inf") else request_rate)
    )
    print(block_row("Max request concurrency:", max_concurrency or "not set"))
    print(block_row("Successful requests:", m["completed"]))
    print(block_row("Benchmark duration (s):", m["duration"]))
    print(block_row("Total input tokens:", m["total_input_tokens"]))
    print(block_row("Total generated tokens:", m["total_output_tokens"]))
    print(block_row("Request throughput (req/s):", m["request_throughput"]))
    print(block_row("Input token throughput (tok/s):", m["input_throughput"]))
    print(block_row("Output token throughput (tok/s):", m["output_throughput"]))
    print(block_row("Total token throughput (tok/s):", m["total_throughput"]))
    print(block_row("Concurrency:", m["concurrency"]))
    if m["accept_length"]:
        print(block_row("Accept length:", m["accept_length"]))
    if "plain_decode_share" in m:
        print(block_row("Tokens decoded plainly:", m["plain_decode_share"]))
    if m.get("spec_buckets"):
        print(f"Speculation by batch bucket: {m['spec_buckets']}")
    if "cache_hit_rate" in m:
        print(block_row("Prefix cache hit rate:", m["cache_hit_rate"]))
        print(block_row("Mean TTFT turn 1 (ms):", m["mean_ttft_turn1_ms"]))
        print(block_row("Mean TTFT turns 2+ (ms):", m["mean_ttft_turn2plus_ms"]))
        print(block_row("Median TTFT turns 2+ (ms):", m["median_ttft_turn2plus_ms"]))
    sections = [
        ("End-to-End Latency", "E2E Latency", "e2e_latency", ("mean", "median", "p90", "p99")),
        ("Time to First Token", "TTFT", "ttft", ("mean", "median", "p99")),
        ("Inter-Token Latency", "ITL", "itl", ("mean", "median", "p95", "p99", "max")),
        ("Time per Output Token (excl. 1st token)", "TPOT", "tpot", ("mean", "median", "p99")),
    ]
    for title, short, key, stats in sections:
        print(block_header(title, fill="-"))
        for stat in stats:
            label = stat.capitalize() if stat in ("mean", "median", "max") else stat.upper()
            print(block_row(f"{label} {short} (ms):", m[f"{stat}_{key}_ms"]))
    print("=" * BLOCK_WIDTH)


def print_serving_ratios(records: list[dict], labels: list[str]) -> None:
    """NEXTN/plain throughput and TPOT ratios of the launched servers (one per variant)."""
    plain = next((r for r, label in zip(records, labels, strict=True) if label == "plain"), None)
    if plain is None:
        return
    for record, label in zip(records, labels, strict=True):
        if label == "plain":
            continue
        print(
            ratio_line(
                f"{label}/plain output token throughput",
                record["output_throughput"],
                plain["output_throughput"],
            )
        )
        print(
            ratio_line(
                f"{label}/plain total token throughput",
                record["total_throughput"],
                plain["total_throughput"],
            )
        )
        print(
            ratio_line(
                f"plain/{label} mean TPOT (speedup)",
                plain["mean_tpot_ms"],
                record["mean_tpot_ms"],
            )
        )


def print_cache_ratios(records: list[dict], labels: list[str]) -> None:
    """Radix cache on/off ratios of each decoding variant (`--compare-radix-cache`): labels
    come in pairs "<variant> cache-off", "<variant> cache-on"."""
    by_label = dict(zip(labels, records, strict=True))
    for label in labels:
        if not label.endswith(" cache-on"):
            continue
        base = label.removesuffix(" cache-on")
        on, off = by_label[label], by_label.get(base + " cache-off")
        if off is None:
            continue
        if "mean_ttft_turn2plus_ms" in on:
            print(
                ratio_line(
                    f"{base} cache on/off mean TTFT turns 2+",
                    on["mean_ttft_turn2plus_ms"],
                    off["mean_ttft_turn2plus_ms"],
                )
            )
        print(ratio_line(f"{base} cache on/off mean TTFT", on["mean_ttft_ms"], off["mean_ttft_ms"]))
        print(
            ratio_line(
                f"{base} cache on/off output token throughput",
                on["output_throughput"],
                off["output_throughput"],
            )
        )


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
