# SPDX-License-Identifier: Apache-2.0
"""`python -m runtime.launch_server ...` as a real process on a free loopback port, for the
tests that talk to a server the way users do (HTTP, the OpenAI SDK, sglang-router)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO_ROOT = Path(__file__).resolve().parents[1]  # `-m runtime...` is this checkout's runtime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started with `flags` (plus `--port`), one torch thread. Its output goes to
    `log_path` (shown when it fails to come up) or is discarded. `wait`: return once
    `/health` answers (else call `wait_healthy`). `env`: variables set for it (None:
    removed); `new_session`: it leads a session (and process group) of its own."""

    def __init__(
        self,
        *flags: str,
        port: int | None = None,
        log_path: Path | None = None,
        wait: bool = True,
        timeout: float = 240,
        env: dict[str, str | None] | None = None,
        new_session: bool = False,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path if log_path is not None else os.devnull, "w")
        cmd = [sys.executable, "-m", "runtime.launch_server", "--port", str(self.port), *flags]
        self.cmd = cmd
        overrides = {"OMP_NUM_THREADS": "1", **(env or {})}
        environment = {**os.environ, **overrides}
        environment = {k: v for k, v in environment.items() if v is not None}
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=new_session,
        )
        self.api_key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
        if wait:
            self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}: {' '.join(self.cmd)}\n"
                    f"{self.output()}"
                )
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server did not come up: {' '.join(self.cmd)}\n{self.output()}")

    def output(self) -> str:
        """What the server printed so far ('' when its output is discarded)."""
        if self.log_path is None:
            return ""
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path, headers=None, **kw):
        kw.setdefault("timeout", 300)
        return requests.post(self.url + path, headers={**self.headers, **(headers or {})}, **kw)

    def get(self, path, headers=None, **kw):
        kw.setdefault("timeout", 120)
        return requests.get(self.url + path, headers={**self.headers, **(headers or {})}, **kw)

    def generate(self, text: str, params: dict) -> dict:
        """`/generate` of one prompt; asserts it succeeded."""
        response = self.post("/generate", json={"text": text, "sampling_params": params})
        assert response.status_code == 200, response.text
        return response.json()

    def info(self) -> dict:
        return self.get("/get_server_info").json()

    def wait_idle(self, timeout=30) -> dict:
        """The scheduler's state once no request runs or waits."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.info()["internal_states"][0]
            if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
                return state
            time.sleep(0.1)
        raise AssertionError("server did not go idle")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
