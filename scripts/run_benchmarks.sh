#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's results table: the three benchmarks on the embedded default model, plain vs
# NEXTN and ours vs HF transformers `generate`, in one run. Prompts are the openings of the
# Python files the default model held out (its domain, not its training data).
#
#   bash scripts/run_benchmarks.sh [OUT_DIR]        # or `make bench`; ~20 min on 2 CPU cores
#
# Every printed table and ratio goes to OUT_DIR/*.log, the JSONL records to OUT_DIR/*.jsonl.
# Extra flags for every script can be given in BENCH_FLAGS (default: fp32, one thread, no progress bars);
# PYTHON picks the interpreter (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-bench_results}
flags=${BENCH_FLAGS:---dtype float32 --threads 1 --disable-tqdm}
python=${PYTHON:-python}
mkdir -p "$out"

"$python" -m scripts.make_code_prompts --num-prompts 64 --prompt-chars 1200 -o "$out/prompts.jsonl"

# shellcheck disable=SC2086  # $flags is a list of flags
"$python" -m scripts.bench_one_batch $flags --compare --hf-baseline --profile-overhead \
    --batch-size 1 4 16 --input-len 128 --output-len 64 --dataset-path "$out/prompts.jsonl" \
    --result-filename "$out/one_batch.jsonl" --plot "$out/one_batch.png" 2>&1 |
    tee "$out/one_batch.log"

# shellcheck disable=SC2086
"$python" -m scripts.bench_offline_throughput $flags --compare --hf-baseline \
    --num-prompts 64 --dataset-path "$out/prompts.jsonl" --random-output-len 64 \
    --result-filename "$out/offline.jsonl" 2>&1 | tee "$out/offline.log"

# shellcheck disable=SC2086
"$python" -m scripts.bench_serving $flags --launch-server --compare --backend sglang \
    --num-prompts 64 --dataset-path "$out/prompts.jsonl" --random-output-len 64 \
    --request-rate inf --output-file "$out/serving.jsonl" 2>&1 | tee "$out/serving.log"

# Multi-turn chats (prefix cache): 16 conversations of 4 turns after a shared 1024-token system
# prompt, 32-token user messages and answers; every variant with the radix cache off and on.
# shellcheck disable=SC2086
"$python" -m scripts.bench_serving $flags --launch-server --compare --compare-radix-cache \
    --backend sglang --dataset-name multiturn --num-prompts 16 --multiturn-turns 4 \
    --multiturn-system-len 1024 --random-input-len 32 --random-output-len 32 \
    --random-range-ratio 1 --request-rate inf --output-file "$out/multiturn.jsonl" 2>&1 |
    tee "$out/multiturn.log"
