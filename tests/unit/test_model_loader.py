# SPDX-License-Identifier: Apache-2.0
"""Checkpoint discovery, header validation, streaming and dequantization (CPU, tiny files).

Expected dequantized values are computed here from the format definitions with explicit
loops over blocks / elements, never by calling the code under test.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from runtime.model_loader import (
    CheckpointError,
    CheckpointIndex,
    block_size_from_config,
    checkpoint_weights,
    dequant_fp8_block,
    dequant_mxfp4,
    dequantize_tensor,
    e8m0_to_float,
    find_checkpoint_files,
    iterate_tensors,
)

E2M1_MAGNITUDE = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}


# ---------------------------------------------------------------- reference quantized data


def make_fp8(out: int, inp: int, block=(128, 128), e8m0: bool = True, seed: int = 0):
    """Random fp8 weight + block scale; returns (weight, scale, expected float32 matrix)."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out, inp, generator=g) * 40).to(torch.float8_e4m3fn)
    nb0, nb1 = math.ceil(out / block[0]), math.ceil(inp / block[1])
    if e8m0:
        scale_bytes = torch.randint(117, 138, (nb0, nb1), generator=g, dtype=torch.uint8)
        scale = scale_bytes.view(torch.float8_e8m0fnu)
        scale_values = [
            [2.0 ** (int(scale_bytes[a, b]) - 127) for b in range(nb1)] for a in range(nb0)
        ]
    else:
        scale = torch.rand(nb0, nb1, generator=g) * 0.01 + 1e-4
        scale_values = [[scale[a, b] for b in range(nb1)] for a in range(nb0)]
    expected = torch.empty(out, inp)
    for a in range(nb0):
        rows = slice(a * block[0], min((a + 1) * block[0], out))
        for b in range(nb1):
            cols = slice(b * block[1], min((b + 1) * block[1], inp))
            expected[rows, cols] = weight[rows, cols].float() * scale_values[a][b]
    return weight, scale, expected


def make_mxfp4(lead: tuple[int, ...], inp: int, signed: bool = True, seed: int = 0):
    """Random packed E2M1 weight + E8M0 scale; returns (packed, scale, expected float32)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*lead, inp), generator=g, dtype=torch.uint8)
    flat_codes = codes.reshape(-1, inp)
    flat_codes[0, :16] = torch.arange(16, dtype=torch.uint8)  # every code, incl. +0 and -0
    scale_bytes = torch.randint(118, 137, (*lead, inp // 32), generator=g, dtype=torch.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    if signed:
        packed = packed.view(torch.int8)
    flat_scale = scale_bytes.reshape(-1, inp // 32)
    rows = []
    for i in range(flat_codes.shape[0]):
        row = []
        for j in range(inp):
            code = int(flat_codes[i, j])
            value = (-1.0 if code & 0x8 else 1.0) * E2M1_MAGNITUDE[code & 0x7]
            row.append(value * 2.0 ** (int(flat_scale[i, j // 32]) - 127))
        rows.append(row)
    expected = torch.tensor(rows, dtype=torch.float32).reshape(*lead, inp)
    return packed, scale_bytes.view(torch.float8_e8m0fnu), expected


def save_sharded(root, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(root / fname))
        weight_map.update({name: fname for name in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


# ---------------------------------------------------------------- E8M0 / FP8 / MXFP4


def test_e8m0_to_float_both_storages():
    raw = torch.tensor([0, 1, 126, 127, 128, 200, 254, 255], dtype=torch.uint8)
    expected = [2.0 ** (int(e) - 127) for e in raw[:-1]]
    for t in (raw, raw.view(torch.float8_e8m0fnu)):
        got = e8m0_to_float(t)
        assert got.dtype == torch.float32
        assert got[:-1].tolist() == expected
        assert torch.isnan(got[-1])
    with pytest.raises(CheckpointError, match="float32"):
        e8m0_to_float(torch.zeros(2))


@pytest.mark.parametrize("e8m0", [True, False])
@pytest.mark.parametrize("shape", [(200, 300), (128, 256), (5, 130)])
def test_dequant_fp8_block_exact(e8m0, shape):
    weight, scale, expected = make_fp8(*shape, e8m0=e8m0)
    assert torch.equal(dequant_fp8_block(weight, scale, dtype=torch.float32), expected)
    got = dequant_fp8_block(weight, scale)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected.to(torch.bfloat16))


def test_dequant_fp8_block_other_block_size_and_raw_byte_scale():
    weight, scale, expected = make_fp8(70, 100, block=(32, 64), seed=3)
    got = dequant_fp8_block(weight, scale.view(torch.uint8), (32, 64), torch.float32)
    assert torch.equal(got, expected)


def test_dequant_fp8_block_wrong_scale_shape():
    weight, scale, _ = make_fp8(200, 300)
    with pytest.raises(CheckpointError, match=r"\(2, 3\)"):
        dequant_fp8_block(weight, scale[:1])


@pytest.mark.parametrize("signed", [True, False])
def test_dequant_mxfp4_exact(signed):
    packed, scale, expected = make_mxfp4((6,), 96, signed=signed)
    assert (expected < 0).any() and (expected == 0).any()
    assert torch.equal(dequant_mxfp4(packed, scale, torch.float32), expected)
    assert torch.equal(dequant_mxfp4(packed, scale.view(torch.uint8), torch.float32), expected)
    assert torch.equal(dequant_mxfp4(packed, scale), expected.to(torch.bfloat16))


def test_dequant_mxfp4_stacked_experts():
    packed, scale, expected = make_mxfp4((3, 4), 64, seed=1)
    assert torch.equal(dequant_mxfp4(packed, scale, torch.float32), expected)


def test_dequantize_tensor_dispatch_and_errors():
    weight, scale, expected = make_fp8(40, 50)
    assert torch.equal(dequantize_tensor(weight, scale, dtype=torch.float32), expected)
    packed, mscale, mexpected = make_mxfp4((4,), 64)
    assert torch.equal(dequantize_tensor(packed, mscale, dtype=torch.float32), mexpected)
    with pytest.raises(CheckpointError, match=r"torch.bfloat16 \(4, 64\)"):
        dequantize_tensor(torch.zeros(4, 64, dtype=torch.bfloat16), mscale)
    with pytest.raises(CheckpointError, match=r"torch.int8 \(4, 32\).*\(4, 1\)"):
        dequantize_tensor(packed, mscale[:, :1])


def test_block_size_from_config():
    assert block_size_from_config({}) == (128, 128)
    assert block_size_from_config({"quantization_config": {"weight_block_size": [64, 32]}}) == (
        64,
        32,
    )
    with pytest.raises(CheckpointError, match="weight_block_size"):
        block_size_from_config({"quantization_config": {"weight_block_size": [0]}})


# ---------------------------------------------------------------- files and headers


def test_single_file(tmp_path):
    tensors = {"a.weight": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert find_checkpoint_files(tmp_path) == [tmp_path / "model.safetensors"]
    index = CheckpointIndex(tmp_path)
    assert sorted(index.names()) == ["a.weight", "b"]
    assert index.has("b") and not index.has("c")
    assert index.shape("a.weight") == (3, 4) and index.dtype("b") == torch.int32
    assert index.file_of("b") == tmp_path / "model.safetensors"
    got = dict(iterate_tensors(index, progress=False))
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    # progress=True is fine without a terminal.
    assert [n for n, _ in iterate_tensors(index, ["b"])] == ["b"]


def test_sharded_with_index(tmp_path):
    shards = {
        "model-00001-of-00003.safetensors": {"x.weight": torch.randn(2, 2)},
        "model-00002-of-00003.safetensors": {"y.weight": torch.randn(3), "z": torch.ones(1)},
        "model-00003-of-00003.safetensors": {"w": torch.zeros(2, dtype=torch.bfloat16)},
    }
    save_sharded(tmp_path, shards)
    save_file({"stray": torch.ones(1)}, str(tmp_path / "consolidated.safetensors"))
    assert [p.name for p in find_checkpoint_files(tmp_path)] == sorted(shards)
    index = CheckpointIndex(tmp_path)
    assert sorted(index.names()) == ["w", "x.weight", "y.weight", "z"]
    assert index.file_of("z").name == "model-00002-of-00003.safetensors"
    got = dict(iterate_tensors(index, progress=False))
    for tensors in shards.values():
        for name, t in tensors.items():
            assert torch.equal(got[name], t) and got[name].dtype == t.dtype


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist.*--model-path"):
        find_checkpoint_files(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        CheckpointIndex(tmp_path / "file")


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        CheckpointIndex(tmp_path)


def test_index_references_missing_file(tmp_path):
    save_sharded(
        tmp_path, {"a.safetensors": {"a": torch.ones(1)}, "b.safetensors": {"b": torch.ones(1)}}
    )
    (tmp_path / "b.safetensors").unlink()
    with pytest.raises(CheckpointError, match="'b.safetensors'.*missing"):
        find_checkpoint_files(tmp_path)


def test_index_lists_tensor_absent_from_shard(tmp_path):
    save_file({"a": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    weight_map = {"a": "a.safetensors", "ghost": "a.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="'ghost'.*a.safetensors"):
        CheckpointIndex(tmp_path)


@pytest.mark.parametrize(
    "content",
    [
        bytes(range(7, 200)),  # garbage: absurd header length
        (20).to_bytes(8, "little") + b"{not json at all....",  # fits, but is not JSON
        b"\x01\x02",  # shorter than the length prefix
    ],
)
def test_corrupt_header(tmp_path, content):
    save_file({"ok": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    (tmp_path / "b.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match="b.safetensors.*corrupt.*re-download"):
        CheckpointIndex(tmp_path)


def test_truncated_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(64), "b": torch.randn(64)}, str(path))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated.*re-download"):
        CheckpointIndex(tmp_path)


def test_missing_tensor(tmp_path):
    save_file({"a": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    index = CheckpointIndex(tmp_path)
    with pytest.raises(CheckpointError, match="missing tensor b"):
        list(iterate_tensors(index, ["a", "b"], progress=False))
    with pytest.raises(CheckpointError, match="missing tensor b"):
        index.shape("b")


# ---------------------------------------------------------------- checkpoint_weights


def test_checkpoint_weights_mixed_sharded(tmp_path):
    fp8_w, fp8_s, fp8_expected = make_fp8(200, 300, seed=1)
    inv_w, inv_s, inv_expected = make_fp8(130, 64, e8m0=False, seed=2)
    hf_w, hf_s, hf_expected = make_fp8(16, 16, seed=4)
    moe_w, moe_s, moe_expected = make_mxfp4((8,), 64, seed=3)
    embed = torch.randn(10, 8).to(torch.bfloat16)
    hc_scale = torch.tensor([0.5, 1.0, 2.0])
    plain_w, plain_s = torch.randn(4, 4).to(torch.bfloat16), torch.ones(1)
    save_sharded(
        tmp_path,
        {
            "model-00001-of-00003.safetensors": {
                "embed.weight": embed,
                "layers.0.attn.wq.weight": fp8_w,  # its scale lives in shard 3
                "layers.0.ffn.experts.0.w1.weight": moe_w,
                "layers.0.ffn.experts.0.w1.scale": moe_s,
            },
            "model-00002-of-00003.safetensors": {
                "layers.1.q_proj.weight": inv_w,
                "layers.1.q_proj.weight_scale_inv": inv_s,
                "layers.1.o_proj.weight": hf_w,
                "layers.1.o_proj.weight_scale": hf_s,
                "layers.0.attn_hc.scale": hc_scale,  # a parameter, not a weight's scale
                "plain.weight": plain_w,  # not quantized: its `.scale` is passed through
                "plain.scale": plain_s,
            },
            "model-00003-of-00003.safetensors": {
                "layers.0.attn.wq.scale": fp8_s,
                "mtp.0.proj.weight": torch.ones(2),
            },
        },
    )
    got = dict(
        checkpoint_weights(
            tmp_path, torch.bfloat16, progress=False, skip=lambda n: n.startswith("mtp.")
        )
    )
    assert sorted(got) == sorted(
        [
            "embed.weight",
            "layers.0.attn.wq.weight",
            "layers.0.ffn.experts.0.w1.weight",
            "layers.1.q_proj.weight",
            "layers.1.o_proj.weight",
            "layers.0.attn_hc.scale",
            "plain.weight",
            "plain.scale",
        ]
    )
    bf16 = torch.bfloat16
    assert torch.equal(got["layers.0.attn.wq.weight"], fp8_expected.to(bf16))
    assert torch.equal(got["layers.1.q_proj.weight"], inv_expected.to(bf16))
    assert torch.equal(got["layers.1.o_proj.weight"], hf_expected.to(bf16))
    assert torch.equal(got["layers.0.ffn.experts.0.w1.weight"], moe_expected.to(bf16))
    for name, stored in [
        ("embed.weight", embed),
        ("layers.0.attn_hc.scale", hc_scale),
        ("plain.weight", plain_w),
        ("plain.scale", plain_s),
    ]:
        assert got[name].dtype == stored.dtype and torch.equal(got[name], stored)


def test_checkpoint_weights_single_file_fp32_and_config_block(tmp_path):
    weight, scale, expected = make_fp8(100, 70, block=(64, 32), seed=5)
    save_file(
        {"l.weight": weight, "l.scale": scale, "orphan.weight_scale_inv": torch.ones(1)},
        str(tmp_path / "model.safetensors"),
    )
    config = {"quantization_config": {"weight_block_size": [64, 32]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    got = dict(checkpoint_weights(tmp_path, torch.float32, block_size=None, progress=False))
    assert sorted(got) == ["l.weight", "orphan.weight_scale_inv"]
    assert torch.equal(got["l.weight"], expected)
    with pytest.raises(CheckpointError, match="cannot dequantize 'l.weight'.*block size"):
        list(checkpoint_weights(tmp_path, torch.float32, progress=False))


def test_checkpoint_weights_bad_path_fails_at_call(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint_weights(tmp_path / "missing", torch.bfloat16)
