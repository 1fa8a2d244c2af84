# SPDX-License-Identifier: Apache-2.0
"""Real server processes on free loopback ports, over a tiny V4 + MTP checkpoint with a
character tokenizer and a chat template."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from tests.tiny_checkpoints import build_tiny_v4_mtp_checkpoint, save_char_tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.devnull, "w")
        cmd = [
            sys.executable,
            "-m",
            "runtime.launch_server",
            *([] if model_path is None else ["--model-path", str(model_path)]),
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--log-level",
            "warning",
            *flags,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.api_key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise RuntimeError("server did not come up")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path, headers=None, **kw):
        return requests.post(
            self.url + path, headers={**self.headers, **(headers or {})}, timeout=120, **kw
        )

    def get(self, path, headers=None, **kw):
        return requests.get(
            self.url + path, headers={**self.headers, **(headers or {})}, timeout=120, **kw
        )

    def info(self) -> dict:
        return self.get("/get_server_info").json()

    def wait_idle(self, timeout=30) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.info()["internal_states"][0]
            if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
                return state
            time.sleep(0.1)
        raise AssertionError("server did not go idle")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory):
    path = build_tiny_v4_mtp_checkpoint(tmp_path_factory.mktemp("served"), seed=21)[0]
    save_char_tokenizer(path, 97)
    return path


@pytest.fixture(scope="session")
def spec_server(served_checkpoint):
    server = ServerProcess(
        served_checkpoint,
        "--speculative-algorithm",
        "NEXTN",
        "--enable-metrics",
        "--chunked-prefill-size",
        "16",
        "--served-model-name",
        "tiny-v4",
        "--max-running-requests",
        "64",
        "--page-size",
        "4",
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def plain_server(served_checkpoint):
    server = ServerProcess(
        served_checkpoint,
        "--api-key",
        "sekret",
        "--enable-metrics",
        "--chunked-prefill-size",
        "16",
        "--served-model-name",
        "tiny-v4",
        "--max-running-requests",
        "64",
    )
    yield server
    server.stop()
