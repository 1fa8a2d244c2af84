#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The standing of docs/benchmarks.md: the three benchmarks on the embedded default model,
# plain vs NEXTN and ours vs HF transformers `generate`, each variant taking turns three
# times, then multi-turn chats with the prefix cache off and on. Prompts are the openings of
# the Python files the default model held out (its domain, not its training data).
#
#   bash scripts/run_benchmarks.sh [OUT_DIR]        # or `make bench`
#
# Captured steps compile the first time (minutes per batch bucket on a CPU, cached under
# $NEXTN_CACHE_DIR), so a first run on a 2-core CPU takes well over an hour; pin it to one
# core (taskset -c 0) for steadier figures. Every printed table and ratio goes to
# OUT_DIR/*.log, the JSONL records to OUT_DIR/*.jsonl, one result file per benchmark to
# RESULTS_DIR (default docs/benchmark_results), and docs/benchmarks.md is rendered from them.
# Extra flags for every script can be given in BENCH_FLAGS (default: fp32, one thread, no
# progress bars); PYTHON picks the interpreter (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-bench_results}
results=${RESULTS_DIR:-docs/benchmark_results}
flags=${BENCH_FLAGS:---dtype float32 --threads 1 --disable-tqdm}
python=${PYTHON:-python}
mkdir -p "$out"

"$python" -m scripts.make_code_prompts --num-prompts 64 --prompt-chars 1200 -o "$out/prompts.jsonl"

# shellcheck disable=SC2086  # $flags is a list of flags
"$python" -m scripts.bench_one_batch $flags --compare --repeats 3 --hf-baseline \
    --prefill-repeats 3 --batch-size 1 16 --input-len 128 --output-len 64 \
    --dataset-path "$out/prompts.jsonl" --result-filename "$out/one_batch.jsonl" \
    --plot "$out/one_batch.png" --results-dir "$results" 2>&1 | tee "$out/one_batch.log"

# shellcheck disable=SC2086
"$python" -m scripts.bench_offline_throughput $flags --compare --repeats 3 --hf-baseline \
    --hf-batch-sizes 4 8 16 --num-prompts 64 --dataset-path "$out/prompts.jsonl" \
    --random-output-len 64 --cuda-graph-bs 1 4 16 64 --chunked-prefill-size 2048 \
    --result-filename "$out/offline.jsonl" --results-dir "$results" 2>&1 |
    tee "$out/offline.log"

# Each server compiles its steps before it answers, so no turn runs beside a compile.
# shellcheck disable=SC2086
"$python" -m scripts.bench_serving $flags --launch-server --compare --repeats 3 \
    --backend sglang --num-prompts 64 --request-rate inf --dataset-name file \
    --dataset-path "$out/prompts.jsonl" --random-output-len 64 \
    --server-args "--capture-compile startup --cuda-graph-bs 1 4 16 64 --chunked-prefill-size 2048" \
    --output-file "$out/serving.jsonl" --results-dir "$results" 2>&1 | tee "$out/serving.log"

# Multi-turn chats (prefix cache): 16 conversations of 4 turns after a shared 1024-token system
# prompt, 32-token user messages and answers; every variant with the radix cache off and on.
# shellcheck disable=SC2086
"$python" -m scripts.bench_serving $flags --launch-server --compare --compare-radix-cache \
    --backend sglang --dataset-name multiturn --num-prompts 16 --multiturn-turns 4 \
    --multiturn-system-len 1024 --random-input-len 32 --random-output-len 32 \
    --random-range-ratio 1 --request-rate inf --output-file "$out/multiturn.jsonl" \
    --results-dir "$results" 2>&1 | tee "$out/multiturn.log"

if [ "$results" = docs/benchmark_results ]; then
    "$python" -m scripts.bench.render
else
    echo "results in $results; docs/benchmarks.md renders from docs/benchmark_results"
fi
