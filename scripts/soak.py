# SPDX-License-Identifier: Apache-2.0
"""Soak test: valid, invalid, aborted and disconnected requests mixed for N minutes.

Runs against a server it launches (`python -m runtime.launch_server` on a free loopback
port, the default model unless `--model-path`; `--server-args` adds flags) or one given by
`--url` (loopback only; pass `--server-pid` for its memory figures). Bounded in time
(`--minutes`) and count (`--max-requests`). `--concurrency` client threads each pick a
kind per request:

* valid: `/generate` (text or ids, streamed or not, n up to 3, seeded or not, logprobs),
  `/v1/completions` and `/v1/chat/completions` (streamed or not); must answer 200 with a
  finished result (a stream must end in [DONE] without an error event);
* invalid: a body from a list of bad ones (bad seeds, out-of-vocabulary ids, lone
  surrogates, invalid UTF-8, n 0, unknown roles, a 2 MB prompt, an over-limit body now and
  then, ...); must answer 4xx;
* costly: a shape that would cost the server far more than its share (issue 56): a huge
  `top_logprobs_num`, every token of a long prompt scored with n = 128, OpenAI `logprobs`
  6 / `top_logprobs` 21, 200+ stop strings, a giant stop string, 10,000 stop ids,
  `chat_template_kwargs` with the keys the server sets itself (`tokenize`,
  `add_generation_prompt`, `tools`, `chat_template`), duplicate OpenAI `rid`s; must
  answer 4xx (valid requests meanwhile include the largest logprob and stop-string
  requests the limits allow);
* aborted: a long request with its own rid, aborted by `/abort_request` after a random
  delay; must answer 200 (finished: aborted, or done first);
* disconnected: a client that gives up (non-streaming timeout, or a stream closed after its
  first event); the server must abort it (checked at the end: nothing runs, no slot lost).

First `/health` is timed while 2 MB prompts (text, token ids, chat) are sent and refused;
then, during the mix, `/health` is timed every 0.25 s and the server's memory sampled.
The report: requests per kind and status, every 5xx and every unexpected answer, /health
latency, RSS at start / end / peak, and the slots and token slots not back after the
server went idle and `/flush_cache` emptied its prefix cache. The exit status is 1 when
any 5xx, unexpected answer or leak was seen.

    python -m scripts.soak --minutes 10 --server-args "--speculative-algorithm NEXTN"
    python -m scripts.soak --url http://127.0.0.1:30000 --server-pid 1234 --minutes 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import requests

from scripts import REPO_ROOT
from scripts.bench.launched_server import free_port

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
USER = [{"role": "user", "content": "write a loop"}]
PROMPTS = ["def fib(n):\n", "import os\n", "class Stack:\n", "for i in range(", "# parse the"]
LONG_PROMPT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (loopback only); default: launch one")
    p.add_argument("--server-pid", type=int, help="pid of the --url server, for its RSS")
    p.add_argument("--model-path", help="checkpoint of the launched server (default model)")
    p.add_argument("--server-args", default="", help="more flags for the launched server")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", help="the server's API key, if it has one")
    p.add_argument("--json", help="also write the report here")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------
# the server


class Server:
    """The server under test: launched here (stopped at the end) or given by URL."""

    def __init__(self, args: argparse.Namespace):
        self.proc, self.log = None, None
        if args.url:
            host = urlparse(args.url).hostname
            if host not in LOOPBACK:
                raise SystemExit(f"soak: --url must be a loopback address, got {host!r}")
            self.url, self.pid = args.url.rstrip("/"), args.server_pid
            return
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "runtime.launch_server", "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--log-level", "warning"]
        if args.model_path:
            cmd += ["--model-path", args.model_path]
        cmd += shlex.split(args.server_args)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="soak_server_", suffix=".log")
        print(f"launching: {shlex.join(cmd)}", flush=True)
        # run from the repository root, so `-m runtime...` is this checkout's runtime
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=dict(os.environ), stdout=self.log, stderr=self.log
        )
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise SystemExit(f"soak: the server exited ({self.proc.returncode})")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise SystemExit("soak: the server did not become healthy")

    def rss_mib(self) -> float | None:
        if self.pid is None:
            return None
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --------------------------------------------------------------------------------------
# requests


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: Counter = field(default_factory=Counter)  # kind -> requests
    statuses: Counter = field(default_factory=Counter)  # (kind, status) -> count
    server_errors: list = field(default_factory=list)  # every 5xx: (kind, status, body head)
    unexpected: list = field(default_factory=list)  # (kind, what happened)
    health_ms: list = field(default_factory=list)
    rss_mib: list = field(default_factory=list)

    def record(self, kind: str, status: int | str, body: str = "") -> None:
        with self.lock:
            self.statuses[(kind, status)] += 1
            if isinstance(status, int) and status >= 500:
                self.server_errors.append((kind, status, body[:300]))

    def oops(self, kind: str, what: str) -> None:
        with self.lock:
            self.unexpected.append((kind, what[:300]))


class Client:
    def __init__(self, url: str, api_key: str | None, tally: Tally):
        self.url, self.tally = url, tally
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def post(self, path, timeout=120, headers=None, **kw):
        headers = {**self.headers, **(headers or {})}
        return requests.post(self.url + path, headers=headers, timeout=timeout, **kw)

    # valid -------------------------------------------------------------------------------
    def valid(self, rng: random.Random) -> None:
        stream = rng.random() < 0.4
        tokens = rng.randint(1, 48)
        route = rng.choice(["generate", "generate", "completions", "chat"])
        if route == "generate":
            params = {"max_new_tokens": tokens, "temperature": rng.choice([0, 0.7, 1.2])}
            if rng.random() < 0.3:
                params["sampling_seed"] = rng.randint(0, 2**40)
            if rng.random() < 0.2:
                params["n"] = rng.randint(2, 3)
            body = {"sampling_params": params, "stream": stream}
            if rng.random() < 0.5:
                body["text"] = rng.choice(PROMPTS)
            else:
                body["input_ids"] = [rng.randint(5, 2000) for _ in range(rng.randint(1, 80))]
            if rng.random() < 0.2:
                body.update(return_logprob=True, top_logprobs_num=2)
            elif rng.random() < 0.1:  # the most a request may ask: every prompt token, top 20
                body.pop("input_ids", None)
                body.update(
                    text=LONG_PROMPT, return_logprob=True, logprob_start_len=0, top_logprobs_num=20
                )
            if rng.random() < 0.1:
                params["stop"] = [f"never{i}" for i in range(63)] + ["\n\n"]
            path = "/generate"
        elif route == "completions":
            body = {"prompt": rng.choice(PROMPTS), "max_tokens": tokens, "stream": stream}
            path = "/v1/completions"
        else:
            body = {"messages": USER, "max_tokens": tokens, "stream": stream}
            path = "/v1/chat/completions"
        response = self.post(path, json=body, stream=stream)
        text = ""
        if response.status_code == 200 and stream:
            events = [x[6:].decode() for x in response.iter_lines() if x.startswith(b"data: ")]
            text = events[-1] if events else ""
            errors = [e for e in events[:-1] if "error" in json.loads(e)]
            if text != "[DONE]" or errors:
                self.tally.oops("valid", f"{path} stream: {(errors or [text])[0][:200]!r}")
        elif response.status_code != 200:
            text = response.text
        self.tally.record("valid", response.status_code, text)
        if response.status_code != 200:
            self.tally.oops("valid", f"{path} {response.status_code}: {text[:200]}")

    # invalid -----------------------------------------------------------------------------
    def invalid_bodies(self, rng: random.Random) -> list[tuple[str, object]]:
        big = "x" * (2 * 2**20)
        bodies = [
            ("/v1/completions", {"prompt": "x", "seed": 2**64}),
            ("/v1/chat/completions", {"messages": USER, "n": 2, "seed": 2**63 - 1}),
            ("/generate", {"text": "x", "sampling_params": {"stop_token_ids": [10**6]}}),
            ("/generate", {"input_ids": [1, 2, 10**7]}),
            ("/v1/completions", {"prompt": [[1], [2, -5]]}),
            ("/generate", '{"text": "a\\ud800b"}'),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}]}'),
            ("/generate", b'{"text": "\xc3\x28"}'),
            ("/generate", {"text": "x", "sampling_params": {"n": 0}}),
            ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
            ("/generate", {"text": "x", "rid": 17}),
            ("/generate", {"text": ["a", "b"], "rid": ["r"]}),
            ("/generate", {"text": "x", "sampling_params": {"n": 10_000}}),
            ("/generate", {"text": "x", "sampling_params": {"temperature": "hot"}}),
            ("/generate", "{broken"),
            ("/generate", {"text": big}),
            ("/v1/completions", {"prompt": big}),
            ("/abort_request", {"rid": f"nobody-{uuid.uuid4().hex}"}),
            ("/v1/chat/completions", {"messages": []}),
        ]
        if rng.random() < 0.02:  # now and then a body over the default 32 MiB limit
            bodies = [("/generate", {"text": "x" * (33 * 2**20)})]
        return bodies

    def costly_bodies(self) -> list[tuple[str, object]]:
        """Shapes past the request limits (docs/serving_limits.md), and chat template
        arguments and request ids the server must refuse: any 4xx will do."""
        scored = {"text": LONG_PROMPT, "return_logprob": True, "logprob_start_len": 0}
        chat = "/v1/chat/completions"
        return [
            ("/generate", {**scored, "top_logprobs_num": 4096}),
            (
                "/generate",
                {**scored, "top_logprobs_num": 20, "sampling_params": {"n": 128}},
            ),
            ("/v1/completions", {"prompt": LONG_PROMPT, "logprobs": 6, "echo": True}),
            (chat, {"messages": USER, "logprobs": True, "top_logprobs": 21}),
            (
                "/generate",
                {"text": "x", "sampling_params": {"stop": [f"s{i}" for i in range(300)]}},
            ),
            ("/v1/completions", {"prompt": "x", "stop": ["z" * 1_000_000]}),
            ("/generate", {"text": "x", "sampling_params": {"stop_token_ids": [7] * 10_000}}),
            (chat, {"messages": USER, "chat_template_kwargs": {"tokenize": True}}),
            (chat, {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}),
            (chat, {"messages": USER, "chat_template_kwargs": {"tools": [{"type": "function"}]}}),
            (chat, {"messages": USER, "chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}),
            ("/v1/completions", {"prompt": ["a", "b"], "rid": ["dup", "dup"], "max_tokens": 4}),
            (chat, {"messages": USER, "rid": ["same", "same"], "max_tokens": 4}),
        ]

    def costly(self, rng: random.Random) -> None:
        path, body = rng.choice(self.costly_bodies())
        response = self.post(path, json=body)
        self.tally.record("costly", response.status_code, response.text)
        if not 400 <= response.status_code < 500:
            what = json.dumps(body)[:120]
            self.tally.oops("costly", f"{path} {what} got {response.status_code}")

    def invalid(self, rng: random.Random) -> None:
        path, body = rng.choice(self.invalid_bodies(rng))
        if isinstance(body, (str, bytes)):
            response = self.post(path, data=body, headers={"content-type": "application/json"})
        else:
            response = self.post(path, json=body)
        self.tally.record("invalid", response.status_code, response.text)
        if not 400 <= response.status_code < 500:
            self.tally.oops("invalid", f"{path} got {response.status_code}: {response.text[:200]}")

    # aborted -----------------------------------------------------------------------------
    def aborted(self, rng: random.Random) -> None:
        rid = f"soak-{uuid.uuid4().hex}"
        params = {"max_new_tokens": rng.randint(100, 400), "ignore_eos": True}
        if rng.random() < 0.3:
            params["n"] = 2
        body = {"text": rng.choice(PROMPTS), "rid": rid, "sampling_params": params}
        result = {}
        thread = threading.Thread(
            target=lambda: result.setdefault("r", self.post("/generate", json=body))
        )
        thread.start()
        time.sleep(rng.uniform(0.05, 1.5))
        abort = self.post("/abort_request", json={"rid": rid})
        thread.join(300)
        response = result.get("r")
        if response is None:
            self.tally.oops("aborted", "no answer within 300 s")
            return
        self.tally.record("aborted", response.status_code, response.text)
        self.tally.record("abort_request", abort.status_code, abort.text)
        if response.status_code != 200 or abort.status_code not in (200, 404):
            self.tally.oops("aborted", f"{response.status_code} / abort {abort.status_code}")
            return
        outs = response.json()
        outs = outs if isinstance(outs, list) else [outs]
        reasons = {o["meta_info"]["finish_reason"]["type"] for o in outs}
        if abort.status_code == 200 and "abort" not in reasons:
            self.tally.oops("aborted", f"aborted but finished with {reasons}")

    # disconnected ------------------------------------------------------------------------
    def disconnected(self, rng: random.Random) -> None:
        body = {
            "text": rng.choice(PROMPTS),
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
        }
        if rng.random() < 0.5:
            try:
                self.post("/generate", json=body, timeout=rng.uniform(0.1, 1.0))
                self.tally.record("disconnected", "finished first")
            except requests.Timeout:
                self.tally.record("disconnected", "gave up")
            return
        with self.post("/generate", json={**body, "stream": True}, stream=True) as response:
            self.tally.record("disconnected", response.status_code)
            for line in response.iter_lines():
                if line:
                    break  # close after the first event


def big_body_probe(client: Client) -> dict:
    """/health latency (max, ms) while 2 MB prompts are parsed and refused, per route and
    body kind; each is sent 3 times, /health is timed every 20 ms meanwhile."""
    big_text = "def f(x):\n    return x\n" * (2 * 2**20 // 24)
    bodies = {
        "generate_text": (
            "/generate",
            {"text": big_text, "sampling_params": {"max_new_tokens": 1}},
        ),
        "generate_ids": ("/generate", {"input_ids": [7] * (2 * 2**20 // 3)}),
        "completions": ("/v1/completions", {"prompt": big_text, "max_tokens": 1}),
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": big_text}]}),
    }
    out = {}
    for name, (path, body) in bodies.items():
        payload = json.dumps(body)
        latencies, done = [], threading.Event()

        def poll(latencies=latencies, done=done):
            while not done.is_set():
                start = time.perf_counter()
                requests.get(client.url + "/health", timeout=60)
                latencies.append((time.perf_counter() - start) * 1000)
                time.sleep(0.02)

        poller = threading.Thread(target=poll)
        poller.start()
        statuses = []
        for _ in range(3):
            response = client.post(path, data=payload, headers={"content-type": "application/json"})
            statuses.append(response.status_code)
        done.set()
        poller.join()
        out[name] = {
            "body_mib": round(len(payload) / 2**20, 2),
            "statuses": statuses,
            "health_max_ms": round(max(latencies), 1),
            "health_p50_ms": round(statistics.median(latencies), 1),
        }
    return out


KINDS = [
    ("valid", 0.45),
    ("invalid", 0.2),
    ("costly", 0.1),
    ("aborted", 0.125),
    ("disconnected", 0.125),
]


def worker(client: Client, tally: Tally, seed: int, deadline: float, budget: list) -> None:
    rng = random.Random(seed)
    names, weights = zip(*KINDS)
    while time.monotonic() < deadline:
        with tally.lock:
            if budget[0] <= 0:
                return
            budget[0] -= 1
        kind = rng.choices(names, weights)[0]
        with tally.lock:
            tally.sent[kind] += 1
        try:
            getattr(client, kind)(rng)
        except requests.RequestException as err:
            tally.record(kind, type(err).__name__)
            tally.oops(kind, f"{type(err).__name__}: {err}")


def monitor(server: Server, tally: Tally, stop: threading.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        try:
            ok = requests.get(server.url + "/health", timeout=30).status_code == 200
        except requests.RequestException:
            ok = False
        tally.health_ms.append((time.perf_counter() - start) * 1000)
        if not ok:
            tally.oops("health", "/health did not answer 200")
        rss = server.rss_mib()
        if rss is not None:
            tally.rss_mib.append((time.monotonic(), rss))
        stop.wait(0.25)


def idle_state(client: Client, timeout: float = 120.0) -> dict:
    """The server's state once nothing runs, after `/flush_cache` gave back the pages the
    prefix cache kept (what it held is reported as `cache_tokens_before_flush`)."""
    deadline = time.monotonic() + timeout
    while True:
        info = requests.get(
            client.url + "/get_server_info", headers=client.headers, timeout=30
        ).json()
        state = info["internal_states"][0]
        if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
            cached = state.get("cache_tokens", 0)
            flushed = client.post("/flush_cache", timeout=30).status_code == 200
            info = requests.get(client.url + "/get_server_info", headers=client.headers).json()
            state = {
                **info["internal_states"][0],
                "cache_tokens_before_flush": cached,
                "flushed": flushed,
            }
            return {
                **state,
                "max_total_tokens": info["max_total_tokens"],
                "max_running_requests": info["max_running_requests"],
            }
        if time.monotonic() > deadline:
            return {
                **state,
                "max_total_tokens": info["max_total_tokens"],
                "max_running_requests": info["max_running_requests"],
                "not_idle": True,
            }
        time.sleep(0.5)


def percentile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def per_minute(samples: list[tuple[float, float]]) -> list[float]:
    """The last RSS sample of each minute of the run."""
    if not samples:
        return []
    first, out = samples[0][0], {}
    for at, rss in samples:
        out[int((at - first) // 60)] = round(rss, 1)
    return [out[m] for m in sorted(out)]


def report(
    args, tally: Tally, start_rss, end_rss, state: dict, seconds: float, probe: dict
) -> dict:
    leaked_tokens = state["max_total_tokens"] - state["available_tokens"]
    leaked_slots = state["max_running_requests"] - state["available_request_slots"]
    out = {
        "minutes": round(seconds / 60, 2),
        "requests": dict(tally.sent),
        "total_requests": sum(tally.sent.values()),
        "statuses": {f"{k}:{s}": n for (k, s), n in sorted(tally.statuses.items(), key=str)},
        "server_errors_5xx": len(tally.server_errors),
        "server_error_samples": tally.server_errors[:5],
        "unexpected": len(tally.unexpected),
        "unexpected_samples": tally.unexpected[:10],
        "health_ms": {
            "p50": round(statistics.median(tally.health_ms), 1) if tally.health_ms else None,
            "p99": round(percentile(tally.health_ms, 0.99), 1),
            "max": round(max(tally.health_ms), 1) if tally.health_ms else None,
            "samples": len(tally.health_ms),
        },
        "rss_mib": {
            "start": start_rss and round(start_rss, 1),
            "end": end_rss and round(end_rss, 1),
            "peak": round(max(r for _, r in tally.rss_mib), 1) if tally.rss_mib else None,
            "per_minute": per_minute(tally.rss_mib),
        },
        "leaked_token_slots": leaked_tokens,
        "leaked_request_slots": leaked_slots,
        "idle_at_end": not state.get("not_idle", False),
        "num_retractions": state.get("num_retractions"),
        "prefix_cache_tokens_before_flush": state.get("cache_tokens_before_flush"),
        "prefix_cache_hit_rate": state.get("cache_hit_rate"),
        "avg_spec_accept_length": state.get("avg_spec_accept_length"),
        "health_during_2mb_prompts": probe,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    server = Server(args)
    try:
        server.wait_ready()
        tally = Tally()
        client = Client(server.url, args.api_key, tally)
        client.post("/generate", json={"text": "warm up", "sampling_params": {"max_new_tokens": 8}})
        probe = big_body_probe(client)
        start_rss = server.rss_mib()
        stop = threading.Event()
        watcher = threading.Thread(target=monitor, args=(server, tally, stop), daemon=True)
        watcher.start()
        began = time.monotonic()
        deadline = began + args.minutes * 60
        budget = [args.max_requests]
        threads = [
            threading.Thread(target=worker, args=(client, tally, args.seed + i, deadline, budget))
            for i in range(args.concurrency)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        state = idle_state(client)
        stop.set()
        watcher.join()
        end_rss = server.rss_mib()
        out = report(args, tally, start_rss, end_rss, state, time.monotonic() - began, probe)
    finally:
        server.stop()
    bad = out["server_errors_5xx"] or out["unexpected"] or out["leaked_token_slots"]
    return 1 if bad or out["leaked_request_slots"] or not out["idle_at_end"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
