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
        (
            ["--speculative-algorithm", "NEXTN", "--speculative-disable-by-batch-size", "0"],
            "--speculative-disable-by-batch-size must be a batch size >= 1",
        ),
        (
            ["--speculative-algorithm", "NEXTN", "--speculative-token-map", "/no/such/freq.pt"],
            "--speculative-token-map '/no/such/freq.pt' does not exist",
        ),
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


def test_launch_server_serves_the_default_model_with_nextn():
    """`launch_server --speculative-algorithm NEXTN` on a fresh clone: no model path needed."""
    import requests

    from tests.server.conftest import serve

    server = serve(None, "--speculative-algorithm", "NEXTN")
    try:
        out = server.post(
            "/generate",
            json={
                "text": "import os\n",
                "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True},
            },
        ).json()
        assert out["meta_info"]["completion_tokens"] == 32
        assert out["meta_info"]["spec_accept_length"] > 1.5
        info = requests.get(server.url + "/get_server_info", timeout=30).json()
        assert info["model_path"].endswith("deepseek_v4_tiny")
        assert info["internal_states"][0]["avg_spec_accept_length"] > 1.5
    finally:
        server.stop()
