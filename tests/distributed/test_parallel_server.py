# SPDX-License-Identifier: Apache-2.0
"""Multi-rank servers as users start them: `--tp-size 2` on one machine, two processes as
`--nnodes 2 --node-rank 0/1`, a rank killed mid-generation, and two replicas behind
sglang-router. Greedy output must equal the one-rank server's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.server_process import ServerProcess, free_port
from tests.tiny_checkpoints import build_tiny_v4_mtp_checkpoint, save_char_tokenizer

pytestmark = pytest.mark.slow

PROMPTS = ["def main(", "The quick brown fox", "x = [1, 2, 3]"]
GREEDY = {"temperature": 0, "max_new_tokens": 24}


def launched(log_dir, name: str, *flags: str, wait: bool = True) -> ServerProcess:
    """A server whose output goes to `<log_dir>/<name>.log`."""
    return ServerProcess(*flags, log_path=log_dir / f"{name}.log", wait=wait)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = build_tiny_v4_mtp_checkpoint(tmp_path_factory.mktemp("tp_served"), seed=21)[0]
    save_char_tokenizer(path, 97)
    return path


def common_flags(checkpoint) -> list[str]:
    return [
        "--model-path",
        str(checkpoint),
        "--dtype",
        "float32",
        "--speculative-algorithm",
        "NEXTN",
        "--served-model-name",
        "tiny",
        "--max-total-tokens",
        "4096",
        "--log-level",
        "info",
    ]


@pytest.fixture(scope="module")
def one_rank(checkpoint, tmp_path_factory):
    server = launched(tmp_path_factory.mktemp("logs"), "tp1", *common_flags(checkpoint))
    yield server
    server.stop()


def answers(server: ServerProcess) -> dict:
    """Greedy answers through /generate and the OpenAI client (completions and chat)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    out = {"generate": [server.generate(p, GREEDY)["text"] for p in PROMPTS]}
    out["completions"] = [
        client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0)
        .choices[0]
        .text
        for p in PROMPTS
    ]
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPTS[1]}],
        max_tokens=24,
        temperature=0,
    )
    out["chat"] = chat.choices[0].message.content
    return out


def test_tp2_nextn_server_answers_like_one_rank(checkpoint, one_rank, tmp_path):
    server = launched(tmp_path, "tp2", *common_flags(checkpoint), "--tp-size", "2")
    try:
        got = answers(server)
        info = server.info()
    finally:
        server.stop()
    assert got == answers(one_rank)
    assert info["tp_size"] == 2 and [m["rank"] for m in info["rank_memory"]] == [0, 1]
    assert "rank 1: weights" in server.output()  # start-up prints every rank's memory


def test_two_nodes_form_one_replica(checkpoint, one_rank, tmp_path):
    rendezvous = f"127.0.0.1:{free_port()}"
    flags = [*common_flags(checkpoint), "--tp-size", "2", "--nnodes", "2"]
    flags += ["--dist-init-addr", rendezvous]
    node0 = launched(tmp_path, "node0", *flags, "--node-rank", "0", wait=False)
    node1 = launched(tmp_path, "node1", *flags, "--node-rank", "1", wait=False)
    try:
        node0.wait_healthy()
        got = [node0.generate(p, GREEDY)["text"] for p in PROMPTS]
        pids = [m["pid"] for m in node0.info()["rank_memory"]]
    finally:
        node0.stop()
        node1.proc.wait(timeout=60)  # rank 0 stopped it
        node1.stop()
    assert got == [one_rank.generate(p, GREEDY)["text"] for p in PROMPTS]
    assert pids[0] == node0.proc.pid and pids[1] == node1.proc.pid
    assert node1.proc.returncode == 0, node1.output()


def test_killing_a_rank_stops_the_server_naming_it(checkpoint, tmp_path):
    server = launched(tmp_path, "doomed", *common_flags(checkpoint), "--tp-size", "2")
    try:
        rank1 = server.info()["rank_memory"][1]["pid"]
        long = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
        threading.Thread(target=lambda: _quietly(server.generate, PROMPTS[0], long)).start()
        deadline = time.time() + 60
        while server.info()["internal_states"][0]["num_running_reqs"] == 0:
            assert time.time() < deadline
            time.sleep(0.05)
        os.kill(rank1, signal.SIGKILL)
        killed_at = time.monotonic()
        server.proc.wait(timeout=30)
        took = time.monotonic() - killed_at
    finally:
        server.stop()
    assert server.proc.returncode != 0
    assert took < 30
    assert f"rank 1 (pid {rank1}) killed by signal SIGKILL" in server.output()


def _quietly(fn, *args):
    try:
        fn(*args)
    except (AssertionError, requests.RequestException):
        pass  # the server is meant to go away under this request


def test_two_replicas_behind_sglang_router(checkpoint, tmp_path):
    pytest.importorskip("sglang_router", reason="pip install sglang-router (the test extra)")
    replicas = [launched(tmp_path, f"replica{i}", *common_flags(checkpoint)) for i in range(2)]
    port = free_port()
    router_log = open(tmp_path / "router.log", "w")
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--worker-urls",
            *[r.url for r in replicas],
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(free_port()),
            "--policy",
            "round_robin",
        ],
        stdout=router_log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert router.poll() is None, (tmp_path / "router.log").read_text()
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.time() < deadline, (tmp_path / "router.log").read_text()
            time.sleep(0.5)

        def one(i: int) -> int:
            if i % 2:
                body = {"model": "tiny", "prompt": PROMPTS[i % 3], "max_tokens": 8}
                return requests.post(url + "/v1/completions", json=body, timeout=300).status_code
            body = {"text": PROMPTS[i % 3], "sampling_params": {"max_new_tokens": 8}}
            return requests.post(url + "/generate", json=body, timeout=300).status_code

        with ThreadPoolExecutor(64) as pool:
            codes = list(pool.map(one, range(64)))
        served = [r.info()["internal_states"][0]["num_finished_reqs"] for r in replicas]
    finally:
        router.send_signal(signal.SIGINT)
        try:
            router.wait(timeout=30)
        except subprocess.TimeoutExpired:
            router.kill()
        router_log.close()
        for r in replicas:
            r.stop()
    assert codes == [200] * 64
    assert all(n > 0 for n in served) and sum(served) >= 64, served
