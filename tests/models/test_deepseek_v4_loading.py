# SPDX-License-Identifier: Apache-2.0
"""Loading DeepSeek-V4 checkpoints: quantized released format, and every error case."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.configs.model_config import ModelConfig
from runtime.model_loader import CheckpointError
from runtime.models.registry import UnsupportedArchitectureError
from tests.models.parity import make_runner, prompt_logits, random_ids
from tests.tiny_checkpoints import build_tiny_v4_checkpoint

FP8_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_fp8_blocks(w: torch.Tensor, block: int, e8m0: bool):
    """Released FP8 format: e4m3 values, one scale per `block x block` tile (a multiplier).
    Returns (fp8 weight, stored scale, the dequantized weight computed tile by tile)."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    deq = torch.empty_like(w)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            if e8m0:
                s = torch.exp2(torch.ceil(torch.log2(s)))
            scale[i, j] = s
            qt = (tile / s).to(torch.float8_e4m3fn)
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = qt
            deq[i * block : (i + 1) * block, j * block : (j + 1) * block] = qt.float() * s
    stored = (
        (torch.log2(scale).round() + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
        if e8m0
        else scale
    )
    return q, stored, deq


def quantize_mxfp4(w: torch.Tensor):
    """Released MXFP4 expert format: E2M1 codes (low nibble first), E8M0 scale per 32 inputs."""
    out_dim, in_dim = w.shape
    groups = w.view(out_dim, in_dim // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-12) / 6.0))
    scale = torch.exp2(exponent)
    scaled = groups / scale.unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    signs = (scaled < 0) & (codes > 0)
    deq = (E2M1[codes] * torch.where(signs, -1.0, 1.0) * scale.unsqueeze(-1)).view(out_dim, in_dim)
    nibbles = (codes | (signs.long() << 3)).view(out_dim, in_dim)
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8)
    stored_scale = (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed, stored_scale, deq


FP8_SUFFIXES = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "indexer.wq_b.weight",
    "shared_experts.w1.weight",
    "shared_experts.w2.weight",
    "shared_experts.w3.weight",
)


@pytest.mark.parametrize("e8m0", [False, True])
def test_quantized_released_checkpoint_loads(tmp_path, e8m0):
    """FP8 block-scaled projections and MXFP4 routed experts load dequantized: logits equal
    those of an unquantized checkpoint holding the same (dequantized) values."""
    source, _ = build_tiny_v4_checkpoint(tmp_path / "src", seed=3, moe_intermediate_size=32)
    state = load_file(str(source / "model.safetensors"))
    quantized, reference = {}, {}
    for name, w in state.items():
        if name.endswith(FP8_SUFFIXES):
            q, s, deq = quantize_fp8_blocks(w, block=8, e8m0=e8m0)
            quantized[name], quantized[name.removesuffix(".weight") + ".scale"] = q, s
            reference[name] = deq
        elif ".experts." in name and "shared" not in name:
            q, s, deq = quantize_mxfp4(w)
            quantized[name], quantized[name.removesuffix(".weight") + ".scale"] = q, s
            reference[name] = deq
        else:
            quantized[name] = reference[name] = w
    config = json.loads((source / "config.json").read_text())
    for directory, tensors, extra in (
        (
            tmp_path / "q",
            quantized,
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "fmt": "e4m3",
                    "scale_fmt": "ue8m0",
                    "weight_block_size": [8, 8],
                    "activation_scheme": "dynamic",
                },
                "expert_dtype": "fp4",
            },
        ),
        (tmp_path / "ref", reference, {}),
    ):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(tensors, str(directory / "model.safetensors"))
    ids = random_ids(33, seed=7)
    logits = []
    for directory in (tmp_path / "q", tmp_path / "ref"):
        runner, table = make_runner(directory)
        logits.append(prompt_logits(runner, table, ids))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


def copy_checkpoint(src, dst, edit):
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(tiny_v4, tmp_path):
    path = copy_checkpoint(tiny_v4[0], tmp_path / "c", lambda s: s.pop("layers.1.attn.wq_b.weight"))
    with pytest.raises(
        ValueError, match=r"(?s)missing 1 required tensor.*model\.layers\.1\.attn\.wq_b\.weight"
    ):
        make_runner(path)


def test_missing_expert_and_stacked_shard_are_named(tiny_v4, tmp_path):
    def edit(state):
        state.pop("layers.2.ffn.experts.3.w2.weight")
        state.pop("layers.0.attn.wkv.weight")  # half of the fused wq_a/wkv projection

    path = copy_checkpoint(tiny_v4[0], tmp_path / "c", edit)
    with pytest.raises(ValueError) as err:
        make_runner(path)
    message = str(err.value)
    assert "model.layers.2.ffn.experts.w2_weight" in message and "('w2', 3)" in message
    assert "model.layers.0.attn.fused_wqa_wkv.weight" in message and "(1,)" in message


def test_shape_mismatch_names_tensor_and_shapes(tiny_v4, tmp_path):
    path = copy_checkpoint(
        tiny_v4[0],
        tmp_path / "c",
        lambda s: s.update({"layers.0.attn.wo_b.weight": torch.zeros(32, 25)}),
    )
    with pytest.raises(
        ValueError, match=r"(?s)layers\.0\.attn\.wo_b\.weight.*expected \(32, 24\), got \(32, 25\)"
    ):
        make_runner(path)


def test_truncated_file_is_reported(tiny_v4, tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(tiny_v4[0], dst)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        make_runner(dst)


def test_wrong_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelConfig.from_path("/nonexistent/checkpoint")


def test_unsupported_architecture_lists_supported(tiny_v4, tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(tiny_v4[0], dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedArchitectureError, match=r"(?s)FooForCausalLM.*supported:.*DeepseekV4ForCausalLM"
    ):
        make_runner(dst)


def test_unsupported_dtype(tiny_v4):
    with pytest.raises(
        ValueError, match="unsupported dtype 'int8'; use one of auto, float32, bfloat16"
    ):
        ModelConfig.from_path(tiny_v4[0], "int8")
