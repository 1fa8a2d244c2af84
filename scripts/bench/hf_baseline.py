# SPDX-License-Identifier: Apache-2.0
"""The HF transformers baseline: `generate` on the same checkpoint, inputs, dtype and torch
threads as our engine, greedy and with EOS off so it makes exactly the tokens ours does.

Two measurements use it: a static batch timed step by step (`bench_one_batch`), and a whole
dataset in left-padded batches of several sizes, keeping the fastest
(`bench_offline_throughput`).

Each runs in a fresh interpreter by default (`in_own_process`): transformers as a user runs
it, with the C allocator's defaults. Our CPU engine changes glibc's `malloc` settings for
the whole process (`runtime.engine.host_malloc`), which speeds transformers' prefill up as
well; `--hf-same-process` measures it in the benchmark's process under those settings."""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from scripts.bench.datasets import WARMUP_OUTPUT_LEN, batch_prompts, warmup_subset
from scripts.bench.report import latency_row, print_hf_batch_row, progress, throughput_summary
from scripts.bench.variants import resolve_torch_dtype, set_threads


def in_own_process(args, measure, *measure_args):
    """`measure(args, *measure_args)` (a module-level function, pickled by name) in a fresh
    interpreter with the benchmark's torch threads, or here with `--hf-same-process`."""
    if args.hf_same_process:
        return measure(args, *measure_args)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(_measure_in_child, measure, args, measure_args).result()


def _measure_in_child(measure, args, measure_args):
    set_threads(args.threads)
    return measure(args, *measure_args)


class TokenClock:
    """A `generate` streamer that only records when each step's tokens arrive: the first
    `put` is the prompt, the second the first new token (after prefill), then one per step."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_hf_model(model_path: str, torch_dtype, quiet: bool = False, device: str = "cpu"):
    """transformers' own implementation of the checkpoint, in `torch_dtype` on `device`,
    eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()  # generation-config chatter is noise here
    if quiet:
        transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    return model.to(device).eval()


def load_for(args, model_path: str):
    """The HF model in the dtype our engine runs `args.dtype` as."""
    dtype = resolve_torch_dtype(model_path, args.dtype, args.device)
    return load_hf_model(model_path, dtype, quiet=args.disable_tqdm, device=args.device)


def hf_generate(model, input_ids, attention_mask, new_tokens: int):
    """Greedy `generate` of exactly `new_tokens` per row; returns (output ids, TokenClock,
    start time). EOS is switched off (`eos_token_id=None`) as ignore_eos does for us: with
    an EOS id, `min_new_tokens` would mask its logit and change the greedy tokens."""
    import torch

    clock = TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
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
# static batches (bench_one_batch)


def static_batch_rows(args, model_path: str, settings, reference: dict) -> list[dict]:
    """Every (batch size, input len, output len) setting through `generate` on the prompts
    our engine saw; `reference` maps a setting to our greedy output ids, to report whether
    HF produced the same tokens."""
    import torch

    model = load_for(args, model_path)
    vocab = model.config.vocab_size
    bs, il, ol = settings[0]
    warm = torch.tensor(batch_prompts(args.seed + 1, bs, il, vocab, args.file_prompts))
    hf_generate(model, warm, torch.ones_like(warm), min(ol, WARMUP_OUTPUT_LEN))
    rows = []
    for bs, il, ol in progress(settings, args.disable_tqdm, desc="HF baseline"):
        ids = torch.tensor(batch_prompts(args.seed, bs, il, vocab, args.file_prompts))
        out, clock, start = hf_generate(model, ids, torch.ones_like(ids), ol)
        prefill = clock.times[1] - start
        repeats = getattr(args, "prefill_repeats", 1)
        if repeats > 1:  # prefill alone: generate one token
            again = [hf_generate(model, ids, torch.ones_like(ids), 1) for _ in range(repeats - 1)]
            prefill = statistics.median([prefill, *(c.times[1] - t for _, c, t in again)])
        decode = clock.times[-1] - clock.times[1]
        arrivals = clock.times[1:-1]  # one per new token (the last entry is the end)
        step_times = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        mine = reference.get((bs, il, ol), [])
        same = sum(o == r for o, r in zip(out.tolist(), mine, strict=False))
        median_step = statistics.median(step_times) if step_times else decode
        row = latency_row(
            run_name=args.run_name,
            variant="HF",
            backend="hf-transformers",
            batch_size=bs,
            input_len=il,
            output_len=ol,
            prefill=prefill,
            decode=decode,
            decode_steps=ol - 1,
            median_step=median_step,
            median_step_throughput=bs / median_step,
            generated=out.numel(),
            accept_length=None,
        )
        row["same_greedy_tokens_as_ours"] = f"{same}/{bs}"
        print_hf_batch_row(row)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------
# whole datasets (bench_offline_throughput)


def similar_length_batches(dataset, batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar lengths (sorted by output then input length),
    which keeps HF's padding and surplus tokens small: the kindest batching for HF."""
    order = sorted(range(len(dataset)), key=lambda i: (dataset[i][1], len(dataset[i][0])))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def run_dataset(model, dataset, batch_size: int, disable_tqdm: bool) -> tuple[float, int]:
    """All (prompt ids, output len) pairs through `generate` in left-padded batches;
    (seconds, tokens generated including those past a shorter request's own length)."""
    import torch

    generated = 0
    start = time.perf_counter()
    batches = similar_length_batches(dataset, batch_size)
    for batch in progress(batches, disable_tqdm, desc=f"HF bs={batch_size}"):
        prompts = [dataset[i][0] for i in batch]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # pad id 0, left
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        new = max(dataset[i][1] for i in batch)
        out, _, _ = hf_generate(model, ids, mask, new)
        generated += out.numel()
    return time.perf_counter() - start, generated


def best_dataset_throughput(args, model_path: str, dataset) -> dict:
    """HF transformers on the same prompts, dtype and threads; the best of
    `--hf-batch-sizes`. Throughput counts the tokens requested (as ours does), not HF's
    padded surplus."""
    if args.disable_ignore_eos:
        print(
            "warning: HF generates every request to its full length (EOS off) while ours may "
            "stop at EOS: drop --disable-ignore-eos for a like-for-like comparison",
            file=sys.stderr,
        )
    model = load_for(args, model_path)
    sizes = sorted({min(b, len(dataset)) for b in args.hf_batch_sizes if b >= 1})
    run_dataset(model, warmup_subset(dataset), sizes[0], True)
    input_tokens = sum(len(ids) for ids, _ in dataset)
    output_tokens = sum(n for _, n in dataset)
    best = None
    for size in sizes:
        duration, generated = run_dataset(model, dataset, size, args.disable_tqdm)
        print(
            f"HF transformers batch size {size}: {duration:.2f} s, "
            f"{output_tokens / duration:.2f} output tok/s ({generated} tokens generated incl. "
            f"{generated - output_tokens} past shorter requests' lengths)"
        )
        if best is None or duration < best[0]:
            best = (duration, size)
    duration, size = best
    result = throughput_summary(
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
