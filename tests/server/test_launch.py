# SPDX-License-Identifier: Apache-2.0
"""`launch_server` flags: SGLang names and defaults, bad combinations refused before loading."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from runtime.server_args import ServerArgs


def test_defaults_and_speculative_resolution(tiny_v4):
    args = ServerArgs.from_cli(["--model-path", str(tiny_v4[0])])
    assert (args.host, args.port, args.max_running_requests, args.speculative_algorithm) == (
        "127.0.0.1",
        30000,
        64,
        None,
    )
    spec = ServerArgs.from_cli(["--model-path", str(tiny_v4[0]), "--speculative-algorithm", "mtp"])
    assert (
        spec.speculative_algorithm,
        spec.speculative_num_steps,
        spec.speculative_eagle_topk,
        spec.speculative_num_draft_tokens,
        spec.max_running_requests,
    ) == ("NEXTN", 3, 1, 4, 48)


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "4"],
            "only chain drafting",
        ),
        (["--speculative-num-steps", "2"], "need --speculative-algorithm"),
        (["--page-size", "0"], "--page-size must be >= 1"),
        (["--dtype", "int4"], "--dtype 'int4' is not supported"),
        (["--port", "70000"], "not a valid TCP port"),
        (["--model-path", "/no/such/model"], "is not a directory"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
    ],
)
def test_bad_flags_fail_before_loading_weights(flags, message):
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "runtime.launch_server", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert time.perf_counter() - start < 30
