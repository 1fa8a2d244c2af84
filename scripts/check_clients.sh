#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Real clients against this server, unchanged: SGLang's bench_serving (backends sglang,
# sglang-oai, sglang-oai-chat) on a local dataset file, an SGLang frontend program (gen,
# select, regex, json_schema, dtype=int, fork, run_batch, streaming), lm-eval's
# local-completions on two small local tasks (loglikelihood and generate_until), and the
# openai SDK with response_format. Everything runs on loopback.
#
#   bash scripts/check_clients.sh [MODE ...]     # modes: nextn plain (default: both)
#
# The clients go into a throwaway virtualenv (VENV, default a temporary directory; it sees
# the system site-packages, so the CPU torch and transformers already installed serve the
# imports sglang makes): `sglang --no-deps` plus the light dependencies its frontend and
# bench_serving import, `openai`, `lm_eval[api]`, `jsonschema`. The server runs from this checkout on the embedded default model. Set
# RECORD_DIR to record every request the clients send (scripts/record_client_requests.py).
# Prints a summary at the end; exits non-zero when a client failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1  # the clients resolve the model from the local path; nothing else
repo=$PWD
modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(nextn plain)
work=$(mktemp -d)
venv=${VENV:-$work/venv}
port=${PORT:-31230}
model=${MODEL_PATH:-$repo/runtime/assets/deepseek_v4_tiny}
summary=$work/summary.txt
server_pid=""
proxy_pid=""

cleanup() {
    [ -n "$proxy_pid" ] && kill "$proxy_pid" 2>/dev/null
    [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null
    wait 2>/dev/null
}
trap cleanup EXIT

note() { echo "$*" | tee -a "$summary"; }

if [ ! -x "$venv/bin/python" ]; then
    echo "== creating the client virtualenv at $venv"
    python -m venv --system-site-packages "$venv"
    # sglang 0.5.6: later releases' bench_serving imports sglang.srt.configs, which needs a
    # CUDA build of torchvision; the frontend and the request shapes are the same
    "$venv/bin/pip" install -q --no-deps "sglang==${SGLANG_VERSION:-0.5.6}"
    "$venv/bin/pip" install -q openai "lm_eval[api]" jsonschema aiohttp requests tqdm numpy \
        orjson msgspec pybase64 pillow datasets psutil pyzmq
fi
py=$venv/bin/python
note "clients: sglang $($py -c 'import importlib.metadata as m; print(m.version("sglang"))'), openai $($py -c 'import openai; print(openai.__version__)'), lm_eval $($py -c 'import importlib.metadata as m; print(m.version("lm_eval"))')"

# a ShareGPT-format dataset file from the standard library's source (the model's domain)
$py - "$work/sharegpt.json" <<'PY'
import json, pathlib, sys, textwrap, os
src = pathlib.Path(os.__file__).read_text().splitlines()
chunks = ["\n".join(src[i : i + 12]) for i in range(0, 12 * 24, 12)]
data = [{"conversations": [{"from": "human", "value": c}, {"from": "gpt", "value": c}]} for c in chunks]
json.dump(data, open(sys.argv[1], "w"))
PY

start_server() {
    local mode=$1
    local flags=(--model-path "$model" --served-model-name deepseek_v4_tiny --host 127.0.0.1
        --port "$port" --dtype float32 --log-level warning --constrained-json-disable-any-whitespace)
    [ "$mode" = nextn ] && flags+=(--speculative-algorithm NEXTN)
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONPATH=$repo python -m runtime.launch_server \
        "${flags[@]}" >"$work/server_$mode.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 240); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
        kill -0 "$server_pid" 2>/dev/null || break
        sleep 0.5
    done
    echo "server did not start:"; cat "$work/server_$mode.log"; exit 1
}

set_client_url() {  # the clients talk to the server, or to the recording proxy before it
    url="http://127.0.0.1:$port"
    if [ -n "${RECORD_DIR:-}" ]; then
        mkdir -p "$RECORD_DIR"
        $py scripts/record_client_requests.py --listen $((port + 1)) --upstream "$url" \
            --out "$RECORD_DIR/$1.jsonl" >"$work/proxy_$1.log" 2>&1 &
        proxy_pid=$!
        sleep 1
        url="http://127.0.0.1:$((port + 1))"
    fi
}

failures=0
run() {  # run NAME COMMAND...: a client's output to its log, its verdict to the summary
    local name=$1; shift
    if "$@" >"$work/$name.log" 2>&1; then
        note "  ok      $name"
    else
        note "  FAILED  $name (log: $work/$name.log)"; tail -20 "$work/$name.log"
        failures=$((failures + 1))
    fi
}

for mode in "${modes[@]}"; do
    note "== mode: $mode"
    start_server "$mode"
    set_client_url "$mode"
    for backend in sglang sglang-oai sglang-oai-chat; do
        run "bench_serving_${backend}_$mode" $py -m sglang.bench_serving --backend "$backend" \
            --base-url "$url" --model "$model" --tokenizer "$model" \
            --dataset-name sharegpt --dataset-path "$work/sharegpt.json" --num-prompts 8 \
            --sharegpt-output-len 32 --request-rate inf --disable-tqdm \
            --output-file "$work/bench_serving_${backend}_$mode.jsonl"
        grep -E "Successful requests|Output token throughput|Accept length" \
            "$work/bench_serving_${backend}_$mode.log" | sed 's/^/          /' | tee -a "$summary"
    done
    run "sgl_frontend_$mode" $py scripts/clients/sgl_program.py "$url"
    grep -E "^sgl:" "$work/sgl_frontend_$mode.log" | sed 's/^/          /' | tee -a "$summary"
    run "lm_eval_$mode" bash -c "cd scripts/clients/lm_eval_tasks && $py -m lm_eval \
        --model local-completions --tasks code_choice,code_complete --include_path . \
        --model_args base_url=$url/v1/completions,model=deepseek_v4_tiny,tokenizer=$model,tokenizer_backend=huggingface,num_concurrent=1,max_retries=1 \
        --output_path $work/lm_eval_$mode"
    grep -E "^\|" "$work/lm_eval_$mode.log" | sed 's/^/          /' | tee -a "$summary"
    run "openai_$mode" $py scripts/clients/openai_structured.py "$url/v1"
    grep -E "^openai:" "$work/openai_$mode.log" | sed 's/^/          /' | tee -a "$summary"
    [ -n "$proxy_pid" ] && kill "$proxy_pid" 2>/dev/null; proxy_pid=""
    kill "$server_pid" 2>/dev/null; wait "$server_pid" 2>/dev/null; server_pid=""
done

echo
echo "==================== summary ===================="
cat "$summary"
echo "clients that failed: $failures (logs in $work)"
exit $((failures > 0))
