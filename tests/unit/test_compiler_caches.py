# SPDX-License-Identifier: Apache-2.0
"""Inductor's caches (and Triton's) go under the runtime's cache directory once an engine is
built, unless the user chose them; inductor's own `cache_dir()` is the oracle."""

from __future__ import annotations

import os

import pytest
import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

from runtime import Engine
from runtime.configs.compiler_caches import TRITON_ENV


@pytest.fixture
def nextn_cache(tmp_path, monkeypatch):
    """`$NEXTN_CACHE_DIR` in a fresh folder; the compiler variables as `import torch._dynamo`
    leaves them (inductor's default written into the environment), restored afterwards."""
    monkeypatch.setenv("NEXTN_CACHE_DIR", str(tmp_path / "nextn"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    monkeypatch.delenv(TRITON_ENV, raising=False)
    return tmp_path / "nextn"


def build(tiny_v4) -> Engine:
    return Engine(model_path=str(tiny_v4[0]), dtype="float32", page_size=4)


def test_engine_points_inductor_under_the_cache_dir(tiny_v4, nextn_cache):
    build(tiny_v4)
    assert cache_dir() == str(nextn_cache / "inductor")
    if TRITON_ENV in os.environ:  # Triton installed
        assert os.environ[TRITON_ENV] == str(nextn_cache / "triton")


@pytest.mark.slow  # a cold inductor compile: ~50 s on a 2-core CPU
def test_compiled_kernels_land_under_the_cache_dir(tiny_v4, nextn_cache):
    build(tiny_v4)
    compiled = torch.compile(lambda x: torch.sin(x) * 2.5 + 0.75, dynamic=False)
    x = torch.linspace(-1, 1, 33)
    torch.testing.assert_close(compiled(x), torch.sin(x) * 2.5 + 0.75)
    written = [p for p in (nextn_cache / "inductor").rglob("*") if p.is_file()]
    assert any(p.suffix in (".so", ".py", ".cpp") for p in written), written


def test_user_chosen_folders_are_kept(tiny_v4, nextn_cache, tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    monkeypatch.setenv(TRITON_ENV, str(tmp_path / "my_triton"))
    build(tiny_v4)
    assert cache_dir() == str(mine)
    assert os.environ[TRITON_ENV] == str(tmp_path / "my_triton")
    assert not (nextn_cache / "inductor").exists()
