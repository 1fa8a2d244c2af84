# SPDX-License-Identifier: Apache-2.0
import os

import pytest
import torch

from tests.tiny_checkpoints import build_tiny_v4_checkpoint

# Tiny models gain nothing from intra-op threads; on a 2-core machine shared with server
# subprocesses, spinning thread pools only slow each other down.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Captured steps compile for minutes on a CPU: engines built by tests (and servers they
# launch) run every step eagerly unless a test turns capture back on
# (tests/engine/test_captured_steps.py covers the captured steps).
os.environ.setdefault("NEXTN_DISABLE_CUDA_GRAPH", "1")


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests skip where torch sees no CUDA device (CI has none)."""
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA device (marked gpu)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(no_cuda)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_v4(tmp_path_factory):
    """(checkpoint dir, transformers model) for the default tiny V4: hc_mult 4, every
    attention kind (window, CSA + indexer, HCA) and both MLP kinds (hash-MoE, MoE)."""
    return build_tiny_v4_checkpoint(tmp_path_factory.mktemp("tiny_v4"), seed=0)


@pytest.fixture(scope="session")
def tiny_v4_hc2(tmp_path_factory):
    """hc_mult 2, sharded into 3 files."""
    return build_tiny_v4_checkpoint(
        tmp_path_factory.mktemp("tiny_v4_hc2"), seed=1, num_shards=3, hc_mult=2
    )


@pytest.fixture
def eager_dynamo(monkeypatch):
    """`torch.compile` traces with dynamo but runs its graphs eagerly (backend "eager"):
    guards, recompiles and compile threads behave as with inductor, in seconds. Steps are
    `torch.compile`d functions, not precompiled ones (only inductor's output can be saved)."""
    from runtime.execution import step_compiler

    monkeypatch.setattr(step_compiler, "PRECOMPILE", False)
    compile_ = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", dynamic=kw["dynamic"])
    )
