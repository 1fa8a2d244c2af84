# SPDX-License-Identifier: Apache-2.0
"""Real server processes on free loopback ports, over a tiny V4 + MTP checkpoint with a
character tokenizer and a chat template."""

from __future__ import annotations

import pytest

from tests.server_process import ServerProcess
from tests.tiny_checkpoints import build_tiny_v4_mtp_checkpoint, save_char_tokenizer


def serve(model_path, *flags: str, **options) -> ServerProcess:
    """A float32 server on `model_path` (None: the embedded default model) that logs only
    warnings; `options` as `ServerProcess` takes them."""
    model = [] if model_path is None else ["--model-path", str(model_path)]
    return ServerProcess(*model, "--dtype", "float32", "--log-level", "warning", *flags, **options)


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory):
    path = build_tiny_v4_mtp_checkpoint(tmp_path_factory.mktemp("served"), seed=21)[0]
    save_char_tokenizer(path, 97)
    return path


@pytest.fixture(scope="session")
def spec_server(served_checkpoint):
    server = serve(
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
    server = serve(
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
