# SPDX-License-Identifier: Apache-2.0
"""Lazy checkpoint windows: a weight loader's narrow reads exactly the rows / columns it
asked for, for plain, FP8-block and MXFP4 tensors (the oracle is the whole tensor read or
dequantized eagerly, then sliced)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from runtime.model_loader import checkpoint_weights
from tests.unit.test_model_loader import make_fp8, make_mxfp4


def windows(shape):
    """A few (dim, start, length) windows per dim, including unaligned ones."""
    for dim, n in enumerate(shape):
        for start, length in ((0, n), (1, n - 3), (n // 2, n - n // 2), (5, 7)):
            if start + length <= n and length > 0:
                yield dim, start, length


@pytest.fixture
def quantized_checkpoint(tmp_path):
    fp8, fp8_scale, _ = make_fp8(300, 260, block=(128, 128))
    packed, mx_scale, _ = make_mxfp4((3, 40), 128)
    save_file(
        {
            "a.weight": fp8,
            "a.weight_scale_inv": fp8_scale,
            "experts.weight": packed,
            "experts.scale": mx_scale,
            "plain.weight": torch.randn(37, 23),
            "bias": torch.randn(11),
        },
        str(tmp_path / "model.safetensors"),
    )
    return tmp_path


def test_lazy_windows_read_what_eager_reading_gives(quantized_checkpoint):
    eager = dict(checkpoint_weights(quantized_checkpoint, torch.float32, progress=False))
    lazy = checkpoint_weights(quantized_checkpoint, torch.float32, progress=False, lazy=True)
    seen = set()
    for name, handle in lazy:
        seen.add(name)
        full = eager[name]
        assert tuple(handle.shape) == tuple(full.shape), name
        torch.testing.assert_close(handle.materialize(), full, rtol=0, atol=0)
        for dim, start, length in windows(full.shape):
            piece = handle.narrow(dim, start, length)
            assert tuple(piece.shape) == tuple(full.narrow(dim, start, length).shape)
            torch.testing.assert_close(
                piece.materialize(), full.narrow(dim, start, length), rtol=0, atol=0
            )
        if full.dim() == 2:  # windows of windows compose
            nested = handle.narrow(0, 2, full.shape[0] - 4).narrow(1, 3, full.shape[1] - 5)
            torch.testing.assert_close(nested.materialize(), full[2:-2, 3:-2], rtol=0, atol=0)
    assert seen == set(eager)


def test_lazy_window_reads_only_its_rows(quantized_checkpoint, monkeypatch):
    """The plain tensor's narrow goes through `get_slice` with the window, never the whole
    tensor."""
    from safetensors import safe_open

    calls = []
    weights = checkpoint_weights(quantized_checkpoint, torch.float32, progress=False, lazy=True)
    handle = dict(weights)["plain.weight"]
    # the handle outlived its iterator's open file: read through a fresh one, spied on
    with safe_open(str(quantized_checkpoint / "model.safetensors"), "pt") as f:

        class Spy:
            def get_slice(self, name):
                calls.append(("slice", name))
                return f.get_slice(name)

            def get_tensor(self, name):
                calls.append(("tensor", name))
                return f.get_tensor(name)

        handle.handle = Spy()
        rows = handle.narrow(0, 10, 5).materialize()
        assert rows.shape == (5, 23)
        assert calls == [("slice", "plain.weight")]
