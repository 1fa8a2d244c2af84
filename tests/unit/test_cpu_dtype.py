# SPDX-License-Identifier: Apache-2.0
"""`--dtype auto` on a CPU serves a bf16 checkpoint in the dtype the host multiplies faster;
an explicit dtype always wins."""

from __future__ import annotations

import logging

import pytest
import torch

from runtime.configs import cpu_dtype
from runtime.configs.model_config import resolve_dtype


@pytest.fixture(autouse=True)
def _fresh_decision():
    cpu_dtype.fastest_cpu_dtype.cache_clear()
    yield
    cpu_dtype.fastest_cpu_dtype.cache_clear()


def test_without_native_bf16_matmul_auto_runs_float32(monkeypatch, caplog):
    monkeypatch.setattr(cpu_dtype, "native_half_matmul", lambda dtype: False)
    with caplog.at_level(logging.INFO, logger="runtime.configs.cpu_dtype"):
        assert resolve_dtype("auto", "bfloat16", "cpu") == torch.float32
    assert "no native bfloat16 matmul" in caplog.text


def _probe_times(monkeypatch, decode_ratio: float, prefill_ratio: float):
    """The probe's products: fp32 takes `ratio` times as long as the half dtype, by shape."""

    def seconds(dtype, rows, *rest):
        ratio = decode_ratio if rows == 1 else prefill_ratio
        return ratio if dtype == torch.float32 else 1.0

    monkeypatch.setattr(cpu_dtype, "_seconds", seconds)


def test_native_bf16_is_kept_only_when_the_probe_says_it_is_faster(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "native_half_matmul", lambda dtype: True)
    _probe_times(monkeypatch, decode_ratio=3.0, prefill_ratio=2.0)
    assert resolve_dtype("auto", "bfloat16", "cpu") == torch.bfloat16
    cpu_dtype.fastest_cpu_dtype.cache_clear()
    # slower on the batch-1 product only: float32
    monkeypatch.setattr(
        cpu_dtype,
        "_seconds",
        lambda dtype, rows, *rest: 3.0 if dtype == torch.bfloat16 and rows == 1 else 2.0,
    )
    assert resolve_dtype("auto", "bfloat16", "cpu") == torch.float32


def test_explicit_dtype_float32_checkpoint_and_other_devices_are_unchanged(monkeypatch):
    def probe_must_not_run(*args):
        raise AssertionError("no probe for an explicit dtype")

    monkeypatch.setattr(cpu_dtype, "_seconds", probe_must_not_run)
    monkeypatch.setattr(cpu_dtype, "native_half_matmul", lambda dtype: True)
    assert resolve_dtype("bfloat16", "bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float32", "bfloat16", "cpu") == torch.float32
    assert resolve_dtype("auto", "float32", "cpu") == torch.float32
    assert resolve_dtype("auto", "bfloat16", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "bfloat16") == torch.bfloat16


@pytest.mark.parametrize("decode_ratio", [0.9, 1.0, 1.5, 2.0])
def test_a_bf16_decode_row_must_beat_float32_by_more_than_its_halved_bytes(
    monkeypatch, caplog, decode_ratio
):
    """float32's decode rows read bf16 copies of a bf16 checkpoint's weights, so a bf16
    product no more than twice as fast as the plain fp32 one saves nothing there: float32,
    however much faster bf16 multiplies prefill rows (the AVX512-BF16 CPU whose probe once
    picked bf16 that then decoded a batch of one 1.7x slower)."""
    monkeypatch.setattr(cpu_dtype, "native_half_matmul", lambda dtype: True)
    _probe_times(monkeypatch, decode_ratio=decode_ratio, prefill_ratio=4.4)
    with caplog.at_level(logging.INFO, logger="runtime.configs.cpu_dtype"):
        assert resolve_dtype("auto", "bfloat16", "cpu") == torch.float32
    assert "1x1024x1024" in caplog.text and "256x" not in caplog.text


def test_float16_has_no_narrow_copies_so_its_decode_row_needs_only_to_be_faster(monkeypatch):
    monkeypatch.setattr(cpu_dtype, "native_half_matmul", lambda dtype: True)
    _probe_times(monkeypatch, decode_ratio=1.5, prefill_ratio=2.0)
    assert resolve_dtype("auto", "float16", "cpu") == torch.float16
    cpu_dtype.fastest_cpu_dtype.cache_clear()
    assert resolve_dtype("auto", "bfloat16", "cpu") == torch.float32
