# SPDX-License-Identifier: Apache-2.0
"""A server `bench_serving` starts itself: `python -m runtime.launch_server` for one
variant on a free loopback port, run from the repository root, stopped at the end."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts import REPO_ROOT
from scripts.bench.variants import Variant

HEALTH_POLL_S = 0.25
HEALTH_REQUEST_TIMEOUT_S = 2.0
STOP_TIMEOUT_S = 20.0


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
            "--device",
            args.device,
            "--log-level",
            "warning",
            "--max-running-requests",
            str(args.max_running_requests),
        ]
        if args.model_path:
            cmd += ["--model-path", args.model_path]
        for name, value in (variant.spec or {}).items():
            flag = f"--{name.replace('_', '-')}"
            cmd += [flag] if value is True else [flag, str(value)]  # True: a switch
        cmd += list(variant.server_flags)
        cmd += shlex.split(args.server_args)
        self.cmd, self.timeout = cmd, args.server_timeout
        # the server's torch threads follow OMP_NUM_THREADS: the same for every variant; it
        # runs from the repository root, so `-m runtime...` is this checkout's runtime
        self.env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
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
                if (
                    requests.get(
                        self.base_url + "/health", timeout=HEALTH_REQUEST_TIMEOUT_S
                    ).status_code
                    == 200
                ):
                    return
            except requests.RequestException:
                pass
            time.sleep(HEALTH_POLL_S)
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
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)  # errors already quoted its tail
