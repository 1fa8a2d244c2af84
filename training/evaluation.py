# SPDX-License-Identifier: Apache-2.0
"""Evaluation of a checkpoint directory: held-out losses of the saved weights, the runtime's
NEXTN acceptance and speed (plain vs NEXTN, batch 1), and transformers as an oracle (its
greedy `generate` equals the runtime's). Writes evaluation.json and the model card."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from training.corpus import checkpoint_corpus, encode_documents
from training.export import load_checkpoint
from training.families import family_of_config
from training.loop import eval_windows, evaluate_heldout, format_metrics
from training.model_card import model_card


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


# Batch-1 engines with their captured steps compiled before any timed request: with the
# default background compile, the first requests run eagerly beside a compiling thread on
# the same cores and the figures measure the compiler.
CAPTURED_AT_BATCH_1 = {"cuda_graph_bs": [1], "capture_compile": "startup"}


def _engine(path: Path, dtype: str, **spec):
    from runtime import Engine

    return Engine(model_path=str(path), dtype=dtype, **CAPTURED_AT_BATCH_1, **spec)


def runtime_report(
    path: Path, prompts: list[str], dtype: str, steps: int, new_tokens: int, threads: int = 1
) -> dict:
    """Serve the checkpoint with the runtime, plain and with NEXTN: speed and acceptance,
    with `threads` torch threads (restored after). `dtype="auto"` is the runtime's own
    choice (on a CPU, the faster of the checkpoint's dtype and float32 on this host)."""
    trained_with = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _runtime_report(path, prompts, dtype, steps, new_tokens)
    finally:
        torch.set_num_threads(trained_with)


def _runtime_report(
    path: Path, prompts: list[str], dtype: str, steps: int, new_tokens: int
) -> dict:
    params = {"temperature": 0, "max_new_tokens": new_tokens}
    plain = _engine(path, dtype)
    dtype = str(plain.model_config.dtype).removeprefix("torch.")
    _warm_up(plain, prompts[0], params)
    plain_results, plain_seconds = _timed_generate(plain, prompts, params)
    del plain
    nextn = _engine(path, dtype, speculative_algorithm="NEXTN", speculative_num_steps=steps)
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
        "captured_steps": True,
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
    from runtime import Engine
    from runtime.engine.tokenizer import load_tokenizer

    family = family_of_config(json.loads((path / "config.json").read_text()))
    tokenizer = load_tokenizer(path, required=True)
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


def _threads(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_evaluation_arguments(group) -> None:
    """The flags `evaluate_checkpoint` reads (besides `spec_steps`), on an argparse group."""
    group.add_argument(
        "--skip-runtime-eval",
        action="store_true",
        help="held-out losses only (no runtime speed / acceptance, no parity check)",
    )
    group.add_argument("--eval-windows", type=int, default=64)
    group.add_argument("--eval-prompts", type=int, default=20)
    group.add_argument("--eval-new-tokens", type=int, default=64)
    group.add_argument(
        "--eval-threads",
        type=_threads,
        default=1,
        help="torch threads of the runtime speed figures: batch-1 decode of a tiny model is "
        "made of small operators, and 2 threads on a 2-core CPU measured 4.5x slower than 1",
    )
    group.add_argument(
        "--eval-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="runtime dtype for the speed figures; auto: the runtime's choice for this host",
    )


def evaluate_checkpoint(path: Path, args) -> dict:
    """Held-out losses of the saved weights, the runtime's NEXTN acceptance and speed, and
    transformers parity; writes evaluation.json and README.md into `path`."""
    summary = json.loads((path / "training.json").read_text())
    config = json.loads((path / "config.json").read_text())
    tokenizer, _, held_sources = checkpoint_corpus(path, summary["corpus"])
    windows = eval_windows(
        encode_documents(tokenizer, [t for _, t in held_sources]),
        args.eval_windows,
        summary["seq_len"],
    )
    model = load_checkpoint(path)
    summary["heldout"] = evaluate_heldout(model, windows, summary["batch_size"], autocast=False)
    summary["heldout_windows"] = len(windows)
    del model
    print("held-out: " + format_metrics(summary["heldout"]), flush=True)
    report = parity = None
    if not args.skip_runtime_eval:
        prompts = eval_prompts(held_sources, args.eval_prompts)
        report = runtime_report(
            path, prompts, args.eval_dtype, args.spec_steps, args.eval_new_tokens, args.eval_threads
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
