# SPDX-License-Identifier: Apache-2.0
"""Online serving benchmark over HTTP (SGLang's `bench_serving` layout).

Drives a running server (`--base-url`, or `--host/--port`) or one it launches itself
(`--launch-server`: `python -m runtime.launch_server` on a free loopback port, stopped at
the end) with N requests arriving as a Poisson process (`--request-rate`, `inf` = all at
once), at most `--max-concurrency` in flight, and reports throughput, TTFT, ITL, TPOT and
end-to-end latency, plus the server's speculative accept length.

    python -m runtime.launch_server --model-path CKPT --speculative-algorithm NEXTN &
    python scripts/bench_serving.py --backend sglang --num-prompts 50 --request-rate 4
    python scripts/bench_serving.py --launch-server --model-path CKPT --compare \\
        --backend sglang-oai --num-prompts 32 --max-concurrency 8

Backends: `sglang` (native `/generate`, random prompts sent as `input_ids`), `sglang-oai`
(`/v1/completions`) and `sglang-oai-chat` (`/v1/chat/completions`), both with random text.
Streaming and ignore_eos are on unless `--disable-stream` / `--disable-ignore-eos`.

Timing: TTFT is the first chunk that carries tokens. Native streams report cumulative
`completion_tokens`, so a chunk's gap is spread over the tokens it carried (one NEXTN round
emits several). OpenAI streams carry no per-chunk token count: the token total comes from
`usage` (or the chunk count) and each chunk gap is divided by the average tokens per chunk
after the first. TPOT = (E2E - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    REPO_ROOT,
    Variant,
    add_model_args,
    append_jsonl,
    block_header,
    block_row,
    build_variants,
    percentiles,
    progress,
    random_lengths,
    random_token_ids,
    ratio_line,
    read_prompt_file,
)

BACKENDS = {
    "sglang": "/generate",
    "sglang-oai": "/v1/completions",
    "sglang-oai-chat": "/v1/chat/completions",
}
REQUEST_TIMEOUT_S = 6 * 3600


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(p)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="sglang")
    p.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--model",
        "--served-model",
        dest="served_model",
        help="model name for the OpenAI backends (default: the first of /v1/models)",
    )
    p.add_argument(
        "--tokenizer", help="tokenizer for random text (default: the server's model path)"
    )
    p.add_argument(
        "--dataset-name",
        choices=("random", "file"),
        default=None,
        help="random prompts, or the prompts of --dataset-path (default: file when "
        "--dataset-path is given)",
    )
    p.add_argument(
        "--dataset-path",
        help='JSONL with "prompt" (and optional "output_len"), or one prompt per line',
    )
    p.add_argument("--num-prompts", type=int, default=50)
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
    p.add_argument(
        "--launch-server",
        action="store_true",
        help="start `python -m runtime.launch_server` (one per variant), stop it after",
    )
    p.add_argument("--server-args", default="", help="extra launch_server flags, one string")
    p.add_argument(
        "--server-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for a launched server's /health",
    )
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    if args.dataset_name is None:
        args.dataset_name = "file" if args.dataset_path else "random"
    if args.dataset_name == "file" and not args.dataset_path:
        p.error("--dataset-name file needs --dataset-path")
    if args.compare and not args.launch_server:
        p.error("--compare needs --launch-server (one server per variant)")
    return args


# --------------------------------------------------------------------------------------
# HTTP helpers


def http_get_json(base_url: str, path: str, timeout: float = 30.0) -> dict:
    import requests

    resp = requests.get(base_url + path, timeout=timeout)
    resp.raise_for_status()
    return resp.json()


def check_reachable(base_url: str) -> None:
    """A clear error when nothing answers at `base_url`."""
    import requests

    try:
        requests.get(base_url + "/health", timeout=10)
    except requests.RequestException as err:
        raise RuntimeError(
            f"no server answers at {base_url} ({type(err).__name__}); start "
            "one with `python -m runtime.launch_server` or pass --launch-server"
        ) from None


def server_accept_length(info: dict) -> float | None:
    """`internal_states[0].avg_spec_accept_length` (SGLang's place), else the top level."""
    states = info.get("internal_states") or [{}]
    value = states[0].get("avg_spec_accept_length", info.get("avg_spec_accept_length"))
    return float(value) if value else None


def served_model_name(base_url: str, requested: str | None) -> str | None:
    if requested:
        return requested
    try:
        return http_get_json(base_url, "/v1/models")["data"][0]["id"]
    except Exception:  # noqa: BLE001 - the name is optional for this server
        return None


# --------------------------------------------------------------------------------------
# dataset


@dataclass
class BenchRequest:
    prompt: str | None
    input_ids: list[int] | None
    prompt_len: int  # client-side estimate; the server's count replaces it
    output_len: int


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def model_vocab_size(model_path: str | None, tokenizer) -> int:
    """The vocabulary random ids are drawn from: config.json of the served checkpoint (when
    it is on this machine), else the tokenizer's size."""
    if model_path and (Path(model_path) / "config.json").is_file():
        config = json.loads((Path(model_path) / "config.json").read_text())
        size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        if size:
            return int(size)
    if tokenizer is not None:
        return len(tokenizer)
    raise ValueError(
        "cannot tell the model's vocabulary size: the server's model path is not "
        "readable here; pass --tokenizer"
    )


def random_texts(rng: random.Random, tokenizer, lengths: list[int]) -> list[str]:
    """Texts decoded from random non-special token ids (SGLang's random dataset); the server
    reports how many tokens each becomes."""
    special = set(tokenizer.all_special_ids)
    usable = [i for i in range(len(tokenizer)) if i not in special]
    return [
        tokenizer.decode([usable[rng.randrange(len(usable))] for _ in range(n)]) for n in lengths
    ]


def build_dataset(args, info: dict) -> list[BenchRequest]:
    """Seeded prompts, the same for every variant of one invocation."""
    rng = random.Random(args.seed)
    model_path = info.get("tokenizer_path") or info.get("model_path")
    needs_text = args.backend != "sglang" and args.dataset_name == "random"
    tokenizer_path = args.tokenizer or model_path
    tokenizer = None
    if needs_text or args.tokenizer:
        if not tokenizer_path:
            raise ValueError("random text needs a tokenizer: pass --tokenizer")
        tokenizer = load_tokenizer(tokenizer_path)
    if args.dataset_name == "file":
        records = read_prompt_file(args.dataset_path)[: args.num_prompts]
        return [
            BenchRequest(
                r["prompt"],
                None,
                len(tokenizer.encode(r["prompt"])) if tokenizer else 0,
                r["output_len"] or args.random_output_len,
            )
            for r in records
        ]
    ins = random_lengths(rng, args.num_prompts, args.random_input_len, args.random_range_ratio)
    outs = random_lengths(rng, args.num_prompts, args.random_output_len, args.random_range_ratio)
    if args.backend == "sglang":
        vocab = model_vocab_size(info.get("model_path"), tokenizer)
        return [
            BenchRequest(None, random_token_ids(rng, n, vocab), n, m)
            for n, m in zip(ins, outs, strict=True)
        ]
    texts = random_texts(rng, tokenizer, ins)
    return [BenchRequest(t, None, n, m) for t, n, m in zip(texts, ins, outs, strict=True)]


# --------------------------------------------------------------------------------------
# one request


@dataclass
class RequestOutput:
    success: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0
    error: str = ""


def sse_events(resp):
    """(arrival time, parsed JSON) per `data:` line until `[DONE]`."""
    for line in resp.iter_lines():
        if not line or not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield time.perf_counter(), json.loads(data)


def payload_for(args, req: BenchRequest, model: str | None) -> dict:
    stream, ignore_eos = not args.disable_stream, not args.disable_ignore_eos
    if args.backend == "sglang":
        body = {
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": req.output_len,
                "ignore_eos": ignore_eos,
            },
            "stream": stream,
        }
        if req.input_ids is not None:
            body["input_ids"] = req.input_ids
        else:
            body["text"] = req.prompt
    else:
        body = {
            "max_tokens": req.output_len,
            "temperature": 0.0,
            "ignore_eos": ignore_eos,
            "stream": stream,
        }
        if model:
            body["model"] = model
        if stream:
            body["stream_options"] = {"include_usage": True}
        if args.backend == "sglang-oai":
            body["prompt"] = req.prompt if req.prompt is not None else req.input_ids
        else:
            body["messages"] = [{"role": "user", "content": req.prompt}]
    if args.extra_request_body:
        body.update(json.loads(args.extra_request_body))
    return body


def send_request(base_url: str, args, req: BenchRequest, model: str | None) -> RequestOutput:
    """POST one request and time it; failures come back as `success=False` with the error."""
    import requests

    out = RequestOutput(prompt_len=req.prompt_len)
    start = time.perf_counter()
    try:
        with requests.post(
            base_url + BACKENDS[args.backend],
            json=payload_for(args, req, model),
            stream=True,
            timeout=REQUEST_TIMEOUT_S,
        ) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {resp.text[:500]}"
                return out
            if args.disable_stream:
                body = resp.json()
                out.latency = out.ttft = time.perf_counter() - start
                read_final(args.backend, body, out)
            elif args.backend == "sglang":
                read_native_stream(resp, start, out)
            else:
                read_openai_stream(resp, start, out, chat=args.backend == "sglang-oai-chat")
    except Exception as err:  # noqa: BLE001 - one failed request must not stop the run
        out.success, out.error = False, f"{type(err).__name__}: {err}"
    return out


def read_final(backend: str, body, out: RequestOutput) -> None:
    """Token counts of a non-streamed response."""
    if backend == "sglang":
        meta = (body[0] if isinstance(body, list) else body)["meta_info"]
        finish_ok(meta.get("finish_reason"), out)
        out.prompt_len, out.output_len = meta["prompt_tokens"], meta["completion_tokens"]
    else:
        usage = body.get("usage") or {}
        out.prompt_len = usage.get("prompt_tokens", out.prompt_len)
        out.output_len = usage.get("completion_tokens", 0)
        reason = (body.get("choices") or [{}])[0].get("finish_reason")
        out.success = reason != "abort"
        out.error = "" if out.success else "request aborted by the server"


def finish_ok(reason, out: RequestOutput) -> None:
    out.success = not (isinstance(reason, dict) and reason.get("type") == "abort")
    if not out.success:
        out.error = f"aborted: {reason.get('message')}"


def read_native_stream(resp, start: float, out: RequestOutput) -> None:
    """`/generate` SSE: cumulative `completion_tokens` tells how many tokens each chunk
    carried, so its gap is spread over them (SGLang's ITL)."""
    seen, last, meta = 0, start, None
    for now, obj in sse_events(resp):
        if "error" in obj:
            out.error = str(obj["error"])
            return
        meta = obj["meta_info"]
        new = meta["completion_tokens"] - seen
        if new <= 0:
            continue
        if seen == 0:
            out.ttft = now - start
        else:
            out.itl.extend([(now - last) / new] * new)
        seen, last = meta["completion_tokens"], now
    out.latency = time.perf_counter() - start
    if meta is None:
        out.error = "the stream ended without a chunk"
        return
    finish_ok(meta.get("finish_reason"), out)
    out.prompt_len, out.output_len = meta["prompt_tokens"], seen


def read_openai_stream(resp, start: float, out: RequestOutput, chat: bool) -> None:
    """OpenAI SSE: chunks carry text but no token count; the total comes from `usage`
    (requested with `stream_options.include_usage`), else one token per chunk."""
    arrivals, usage, aborted = [], None, False
    for now, obj in sse_events(resp):
        if "error" in obj:
            out.error = str(obj["error"])
            return
        usage = obj.get("usage") or usage
        for choice in obj.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            reason = choice.get("finish_reason")
            aborted |= reason == "abort"
            if text or reason:  # a finish chunk may carry tokens whose text is empty
                arrivals.append(now)
    out.latency = time.perf_counter() - start
    if not arrivals:
        out.error = "the stream ended without a token"
        return
    out.ttft = arrivals[0] - start
    out.output_len = (usage or {}).get("completion_tokens", len(arrivals))
    out.prompt_len = (usage or {}).get("prompt_tokens", out.prompt_len)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    if gaps:
        per_chunk = max(out.output_len - 1, 1) / len(gaps)  # tokens per chunk after the first
        out.itl = [g / per_chunk for g in gaps]
    out.success, out.error = not aborted, "request aborted by the server" if aborted else ""


# --------------------------------------------------------------------------------------
# the run


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """SGLang's arrivals: the first at 0, then exponential gaps (Poisson process)."""
    if rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(count):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def run_requests(base_url: str, args, dataset: list[BenchRequest], model: str | None):
    """All requests on their arrival schedule; a pool of `max_concurrency` workers holds the
    rest back like SGLang's semaphore. Returns (outputs, benchmark seconds)."""
    workers = args.max_concurrency or len(dataset)
    arrivals = arrival_times(len(dataset), args.request_rate, args.seed)
    bar = progress(total=len(dataset), disable=args.disable_tqdm, desc="requests")
    lock = threading.Lock()

    def task(req: BenchRequest) -> RequestOutput:
        result = send_request(base_url, args, req, model)
        with lock:
            bar.update(1)
        return result

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = []
        for req, at in zip(dataset, arrivals, strict=True):
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(task, req))
        outputs = [f.result() for f in futures]
    duration = time.perf_counter() - start
    bar.close()
    return outputs, duration


def calculate_metrics(outputs: list[RequestOutput], duration: float) -> dict:
    """SGLang's metrics (times in ms)."""
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


def print_result(args, m: dict) -> None:
    """SGLang's "Serving Benchmark Result" block."""
    rate = args.request_rate
    print("\n" + block_header("Serving Benchmark Result"))
    print(block_row("Backend:", args.backend))
    print(block_row("Traffic request rate:", "inf" if rate == float("inf") else rate))
    print(block_row("Max request concurrency:", args.max_concurrency or "not set"))
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
    print("=" * 50)


def benchmark(args, base_url: str, variant: Variant | None) -> dict:
    """Warm up, run the dataset against `base_url`, print and record the result."""
    info = http_get_json(base_url, "/get_server_info")
    model = served_model_name(base_url, args.served_model) if args.backend != "sglang" else None
    dataset = build_dataset(args, info)
    spec = info.get("speculative_algorithm")
    label = (
        variant.label
        if variant
        else (f"{spec}(steps={info.get('speculative_num_steps')})" if spec else "plain")
    )
    print(
        f"\nserver {base_url}: model {info.get('model_path')}, dtype {info.get('dtype')}, "
        f"decoding {label}, {len(dataset)} prompts, backend {args.backend}"
    )
    for _ in range(args.warmup_requests):
        warm = send_request(base_url, args, dataset[0], model)
        if not warm.success:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
    outputs, duration = run_requests(base_url, args, dataset, model)
    failed = [o for o in outputs if not o.success]
    if failed:
        print(f"warning: {len(failed)} requests failed, e.g. {failed[0].error}", file=sys.stderr)
    metrics = calculate_metrics(outputs, duration)
    # cumulative since the server started (SGLang reads it the same way): includes warm-up
    metrics["accept_length"] = server_accept_length(http_get_json(base_url, "/get_server_info"))
    print_result(args, metrics)
    record = {
        "backend": args.backend,
        "variant": label,
        "dataset_name": args.dataset_name,
        "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "num_prompts": len(dataset),
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


# --------------------------------------------------------------------------------------
# launched servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`python -m runtime.launch_server` for one variant on a free loopback port, its log in
    a temporary file; a context manager that waits for /health and stops it on exit."""

    def __init__(self, args, variant: Variant):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "runtime.launch_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            args.dtype,
            "--log-level",
            "warning",
            "--max-running-requests",
            str(args.max_running_requests),
        ]
        if args.model_path:
            cmd += ["--model-path", args.model_path]
        for name, value in (variant.spec or {}).items():
            cmd += [f"--{name.replace('_', '-')}", str(value)]
        cmd += shlex.split(args.server_args)
        self.cmd, self.timeout = cmd, args.server_timeout
        # the server's torch threads follow OMP_NUM_THREADS: the same for every variant
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": str(args.threads),
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])
            ),
        }
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="bench_server_", suffix=".log", delete=False
        )
        self.proc = None

    def __enter__(self) -> LaunchedServer:
        print(f"launching: {shlex.join(self.cmd)} (log: {self.log.name})", flush=True)
        self.proc = subprocess.Popen(
            self.cmd, cwd=str(REPO_ROOT), env=self.env, stdout=self.log, stderr=subprocess.STDOUT
        )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self) -> None:
        import requests

        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with code {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if requests.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        raise RuntimeError(
            f"the server was not healthy after {self.timeout:.0f} s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text().splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)  # errors already quoted its tail


def print_ratios(records: list[dict], variants: list[Variant]) -> None:
    plain = next((r for r, v in zip(records, variants, strict=True) if v.is_plain), None)
    if plain is None:
        return
    for record, v in zip(records, variants, strict=True):
        if v.is_plain:
            continue
        print(
            ratio_line(
                f"{v.label}/plain output token throughput",
                record["output_throughput"],
                plain["output_throughput"],
            )
        )
        print(
            ratio_line(
                f"{v.label}/plain total token throughput",
                record["total_throughput"],
                plain["total_throughput"],
            )
        )
        print(
            ratio_line(
                f"plain/{v.label} mean TPOT (speedup)",
                plain["mean_tpot_ms"],
                record["mean_tpot_ms"],
            )
        )


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    try:
        variants = build_variants(args)
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
            return records
        for variant in variants:
            with LaunchedServer(args, variant) as server:
                records.append(benchmark(args, server.base_url, variant))
    except (RuntimeError, ValueError, OSError) as err:
        print(f"bench_serving: error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    print_ratios(records, variants)
    return records


if __name__ == "__main__":
    main()
