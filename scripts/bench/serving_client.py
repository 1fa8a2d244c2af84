# SPDX-License-Identifier: Apache-2.0
"""The HTTP side of `bench_serving`: one request per backend (`/generate`,
`/v1/completions`, `/v1/chat/completions`), streamed or not, timed SGLang's way, and a run
of many on a Poisson arrival schedule with at most `--max-concurrency` in flight, or of
multi-turn conversations (each conversation's turns one after another, its next prompt built
from the answers the server gave).

Timing: TTFT is the first chunk that carries tokens. Native streams report cumulative
`completion_tokens`, so a chunk's gap is spread over the tokens it carried (one NEXTN round
emits several). OpenAI streams carry no per-chunk token count: the token total comes from
`usage` (or the chunk count) and each chunk gap is divided by the average tokens per chunk
after the first."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from scripts.bench.datasets import BenchRequest, Conversation
from scripts.bench.report import plain_share, progress

BACKENDS = {
    "sglang": "/generate",
    "sglang-oai": "/v1/completions",
    "sglang-oai-chat": "/v1/chat/completions",
}
REQUEST_TIMEOUT_S = 6 * 3600
HTTP_TIMEOUT_S = 30.0  # server info and model list
REACHABLE_TIMEOUT_S = 10.0


def http_get_json(base_url: str, path: str, timeout: float = HTTP_TIMEOUT_S) -> dict:
    import requests

    resp = requests.get(base_url + path, timeout=timeout)
    resp.raise_for_status()
    return resp.json()


def flush_cache(base_url: str, timeout: float = HTTP_TIMEOUT_S) -> None:
    """`POST /flush_cache` (SGLang's): the server's prefix cache forgets everything, so a
    repeated run of the same prompts prefills them again."""
    import requests

    resp = requests.post(base_url + "/flush_cache", timeout=timeout)
    if resp.status_code != 200:
        raise RuntimeError(f"{base_url}/flush_cache answered {resp.status_code}: {resp.text}")


def check_reachable(base_url: str) -> None:
    """A clear error when nothing answers at `base_url`."""
    import requests

    try:
        requests.get(base_url + "/health", timeout=REACHABLE_TIMEOUT_S)
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


def server_speculation_choices(info: dict) -> dict:
    """What a NEXTN server's speculation policy did (cumulative since start): the share of
    decoded tokens from steps that did not speculate, and per measured batch bucket
    whether it speculates, with its round and plain step times (and those of a start-up
    calibration). Empty for plain servers."""
    states = info.get("internal_states") or [{}]
    plain = states[0].get("spec_plain_decode_tokens")
    if plain is None:
        return {}
    emitted = states[0].get("spec_emitted_tokens") or 0
    out = {"plain_decode_share": plain_share(plain, emitted) or 0.0}
    buckets = states[0].get("spec_buckets") or {}
    if buckets:
        out["spec_buckets"] = "; ".join(
            f"{bucket}: {'on' if b['speculates'] else 'off'} "
            f"(round {b['round_ms']} ms x {b['rounds']}, plain {b['plain_ms']} ms x "
            f"{b['plain_steps']}{calibrated(b)}{loading(b)})"
            for bucket, b in buckets.items()
        )
    return out


def calibrated(bucket: dict) -> str:
    """A bucket's times before the traffic (start-up calibration), if it has them."""
    if bucket.get("calibrated_round_ms") is None:
        return ""
    return (
        f"; calibrated round {bucket['calibrated_round_ms']} ms, "
        f"plain {bucket['calibrated_plain_ms']} ms"
    )


def loading(bucket: dict) -> str:
    """A bucket's times of steps beside a compile (its background loads), if it has them."""
    if "loading_round_ms" not in bucket:
        return ""
    return (
        f"; while loading round {bucket['loading_round_ms']} ms, "
        f"plain {bucket['loading_plain_ms']} ms"
    )


def served_model_name(base_url: str, requested: str | None) -> str | None:
    if requested:
        return requested
    try:
        return http_get_json(base_url, "/v1/models")["data"][0]["id"]
    except Exception:  # noqa: BLE001 - the name is optional for this server
        return None


@dataclass
class RequestOutput:
    success: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0
    error: str = ""
    cached_tokens: int = 0  # prompt tokens the server's prefix cache served (native backend)
    output_ids: list[int] | None = None  # native backend
    turn: int = 0  # multi-turn dataset: 0 for a conversation's first turn


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
        first = body[0] if isinstance(body, list) else body
        meta = first["meta_info"]
        finish_ok(meta.get("finish_reason"), out)
        out.prompt_len, out.output_len = meta["prompt_tokens"], meta["completion_tokens"]
        out.cached_tokens, out.output_ids = meta.get("cached_tokens", 0), first.get("output_ids")
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
        meta, out.output_ids = obj["meta_info"], obj.get("output_ids")
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
    out.cached_tokens = meta.get("cached_tokens", 0)


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


def run_conversations(
    base_url: str, args, conversations: list[Conversation], model: str | None
) -> tuple[list[RequestOutput], float]:
    """Multi-turn chats (native backend): conversations start on the arrival schedule, at most
    `max_concurrency` at a time; within one, turn k+1 is sent when turn k's answer is back,
    as `Conversation.prompt` of the answers so far. Returns (outputs of every turn, seconds)."""
    workers = args.max_concurrency or len(conversations)
    arrivals = arrival_times(len(conversations), args.request_rate, args.seed)
    total = sum(len(c.users) for c in conversations)
    bar = progress(total=total, disable=args.disable_tqdm, desc="turns")
    lock = threading.Lock()

    def converse(conv: Conversation) -> list[RequestOutput]:
        outputs, answers = [], []
        for turn, output_len in enumerate(conv.output_lens):
            ids = conv.prompt(turn, answers)
            out = send_request(base_url, args, BenchRequest(None, ids, len(ids), output_len), model)
            out.turn = turn
            outputs.append(out)
            with lock:
                bar.update(1)
            if not out.success or out.output_ids is None:
                break  # the conversation cannot go on without the answer
            answers.append(out.output_ids)
        return outputs

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = []
        for conv, at in zip(conversations, arrivals, strict=True):
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(converse, conv))
        outputs = [o for f in futures for o in f.result()]
    duration = time.perf_counter() - start
    bar.close()
    return outputs, duration
