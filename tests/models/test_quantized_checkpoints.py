# SPDX-License-Identifier: Apache-2.0
"""Quantized DeepSeek-V4 checkpoints served as shipped (`--quantization`).

Tiny held-out checkpoints with random weights, quantized by the test's own statement of
the released formats (`quantize_fp8_blocks`, `quantize_mxfp4`): FP8 block projections
with MXFP4 routed experts (V4), or FP8 routed experts too (V3 style), each with an MTP layer.
The oracle is the same checkpoint dequantized on load (`--quantization none`).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import Engine
from runtime.configs.model_config import ModelConfig
from runtime.core.forward_mode import ForwardMode
from runtime.execution.model_runner import ModelInput
from runtime.model_loader import CheckpointError
from runtime.model_loader.build import load_model
from tests.models.test_deepseek_v4_loading import (
    FP8_SUFFIXES,
    quantize_fp8_blocks,
    quantize_mxfp4,
)
from tests.models.test_deepseek_v4_parity import all_rows, random_ids
from tests.runners import load_runner
from tests.tiny_checkpoints import build_tiny_v4_mtp_checkpoint

BLOCK = 8
MTP_FP8_SUFFIXES = ("e_proj.weight", "h_proj.weight")
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def is_routed_expert(name: str) -> bool:
    return ".experts." in name and "shared" not in name


def write_quantized(source, target, experts: str, edit=None, block: int = BLOCK, tail: int = 0):
    """`source`'s checkpoint with FP8-block projections and `experts` ("mxfp4" / "fp8")
    routed experts, saved at `target`; `edit(state)` may corrupt it first."""
    state = load_file(str(source / "model.safetensors"))
    out = {}
    for name, w in state.items():
        scale_name = name.removesuffix(".weight") + ".scale"
        if name.endswith(FP8_SUFFIXES + MTP_FP8_SUFFIXES) or (
            experts == "fp8" and is_routed_expert(name)
        ):
            out[name], out[scale_name], _ = quantize_fp8_blocks(w, block=block, e8m0=True)
        elif is_routed_expert(name):
            out[name], out[scale_name], _ = quantize_mxfp4(w)
        else:
            out[name] = w
    if edit is not None:
        edit(out)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [block, block],
        "activation_scheme": "dynamic",
    }
    if experts == "mxfp4":
        config["expert_dtype"] = "fp4"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(config))
    save_file(out, str(target / "model.safetensors"))
    return target


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path, _, _ = build_tiny_v4_mtp_checkpoint(
        tmp_path_factory.mktemp("src"), seed=5, moe_intermediate_size=32
    )
    return path


@pytest.fixture(scope="module", params=["mxfp4", "fp8"])
def quantized(request, source, tmp_path_factory):
    return request.param, write_quantized(source, tmp_path_factory.mktemp("q"), request.param)


def prefill_logits(path, quantization: str) -> torch.Tensor:
    from runtime.cache.slot_table import PagedTokenAllocator, ReqToTokenPool, SlotTable

    config = ModelConfig.from_path(path, "float32", quantization=quantization)
    table = SlotTable(ReqToTokenPool(4, 256), PagedTokenAllocator(256, 1))
    runner = load_runner(config, table)
    ids = random_ids(29, seed=11)
    req = table.open_request()
    table.reserve(req, len(ids))
    out = runner.forward(
        ModelInput(
            ForwardMode.EXTEND, ids, [req], [0], [len(ids)], logits_row_indices=all_rows(len(ids))
        )
    )
    return out.next_token_logits


def quantized_modules(model):
    return [(n, m) for n, m in model.named_modules() if getattr(m, "quantized_weights", None)]


def test_weights_stay_quantized(quantized):
    """Every FP8 projection holds e4m3 codes with one fp32 scale per row and block; routed
    experts hold their checkpoint's codes (MXFP4: a byte per two values, an E8M0 byte per
    32), so the bytes per parameter are the format's."""
    experts, path = quantized
    model = load_model(ModelConfig.from_path(path, "float32"), progress=False)
    found = dict(quantized_modules(model))
    for suffix in ("attn.wq_b", "attn.wo_a", "attn.wo_b", "shared_experts.down_proj"):
        assert any(n.endswith(suffix) for n in found), suffix
    for module in found.values():
        for param, (fmt, block_k) in module.quantized_weights.items():
            codes = getattr(module, param)
            if fmt == "fp8":
                scales = getattr(module, param + "_scale_inv")
                assert codes.dtype == torch.float8_e4m3fn and block_k == BLOCK
                assert scales.shape == (*codes.shape[:-1], -(-codes.shape[-1] // BLOCK))
            else:
                scales = getattr(module, param + "_scale")
                assert codes.dtype == torch.uint8 and scales.dtype == torch.uint8
                assert scales.shape[-1] * 16 == codes.shape[-1]
            values = codes.numel() * (2 if fmt == "mxfp4" else 1)
            held = codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
            expected = 1 + 4 / BLOCK if fmt == "fp8" else 0.5 + 1 / 32
            assert held / values == pytest.approx(expected)
    routed = [m for n, m in found.items() if n.endswith(".experts")]
    assert routed and {m.quantized_weights["w13_weight"][0] for m in routed} == {experts}


def test_logits_equal_dequantize_on_load(quantized):
    _, path = quantized
    torch.testing.assert_close(
        prefill_logits(path, "auto"), prefill_logits(path, "none"), atol=2e-5, rtol=1e-5
    )


def test_draft_weights_stay_quantized(quantized):
    """The MTP layer's projections (`e_proj`, `h_proj`, attention, experts) keep codes too."""
    from runtime.models.registry import resolve_model_class

    _, path = quantized
    config = ModelConfig.from_path(path, "float32")
    draft_cls = resolve_model_class([resolve_model_class(config.architectures).draft_architecture])
    found = dict(quantized_modules(load_model(config, draft_cls, progress=False)))
    for suffix in ("e_proj", "h_proj", "attn.wq_b", ".experts"):
        assert any(n.endswith(suffix) for n in found), suffix


def generate(path, quantization: str, **engine_args):
    engine = Engine(
        model_path=str(path),
        dtype="float32",
        page_size=4,
        max_running_requests=4,
        max_total_tokens=512,
        quantization=quantization,
        **engine_args,
    )
    prompts = [random_ids(n, seed=n).tolist() for n in (5, 13, 21)]
    try:
        out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    finally:
        engine.shutdown()
    return [r["output_ids"] for r in out]


@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "NEXTN"}], ids=["plain", "nextn"])
def test_greedy_tokens_equal_dequantize_on_load(quantized, spec):
    _, path = quantized
    assert generate(path, "auto", **spec) == generate(path, "none", **spec)


def corrupt_fp8_scale(state):
    name = "layers.1.attn.wq_b.scale"
    state[name] = state[name][:-1]


def nan_mxfp4_scale(state):
    name = "layers.0.ffn.experts.3.w2.scale"
    state[name] = state[name].view(torch.uint8).clone().fill_(255).view(torch.float8_e8m0fnu)


def short_mxfp4_scale(state):
    name = "layers.2.ffn.experts.1.w1.scale"
    state[name] = state[name][:, :-1]


def nan_fp8_code(state):
    name = "layers.3.attn.wo_a.weight"
    codes = state[name].view(torch.uint8).clone()
    codes[0, 0] = 0x7F
    state[name] = codes.view(torch.float8_e4m3fn)


def wrong_codes_shape(state):
    name = "layers.0.attn.wo_b.weight"
    state[name] = torch.cat([state[name], state[name][:1]])
    scale = "layers.0.attn.wo_b.scale"
    state[scale] = torch.cat([state[scale], state[scale][:1]])


@pytest.mark.parametrize(
    "edit, tensor",
    [
        (corrupt_fp8_scale, "layers.1.attn.wq_b"),
        (nan_mxfp4_scale, "layers.0.ffn.experts.3.w2"),
        (short_mxfp4_scale, "layers.2.ffn.experts.1.w1"),
        (nan_fp8_code, "layers.3.attn.wo_a"),
        (wrong_codes_shape, "layers.0.attn.wo_b"),
    ],
)
def test_malformed_quantized_tensors_are_refused_by_name(source, tmp_path, edit, tensor):
    path = write_quantized(source, tmp_path / "bad", "mxfp4", edit=edit)
    with pytest.raises(ValueError, match=tensor.replace(".", r"\.")):
        load_model(ModelConfig.from_path(path, "float32"), progress=False)


def test_explicit_format_the_checkpoint_lacks_is_refused(source, quantized):
    experts, path = quantized
    with pytest.raises(CheckpointError, match="holds no fp8 weights"):
        load_model(ModelConfig.from_path(source, "float32", quantization="fp8"), progress=False)
    if experts == "fp8":
        with pytest.raises(CheckpointError, match="holds no mxfp4 weights"):
            load_model(ModelConfig.from_path(path, "float32", quantization="mxfp4"))


def test_one_format_kept_the_other_dequantized(quantized):
    """`--quantization fp8` on a V4 checkpoint keeps the FP8 projections and dequantizes the
    MXFP4 experts; logits still equal dequantize-on-load."""
    experts, path = quantized
    if experts != "mxfp4":
        pytest.skip("needs both formats")
    model = load_model(ModelConfig.from_path(path, "float32", quantization="fp8"), progress=False)
    formats = {fmt for _, m in quantized_modules(model) for fmt, _ in m.quantized_weights.values()}
    assert formats == {"fp8"}
    torch.testing.assert_close(
        prefill_logits(path, "fp8"), prefill_logits(path, "none"), atol=2e-5, rtol=1e-5
    )


QWEN_FP8 = (
    "_proj.weight",  # attention, Gated DeltaNet and shared-expert projections
)


def test_qwen4_exp_fp8_checkpoint(tmp_path):
    """A Qwen4Exp checkpoint in Hugging Face's FP8 naming (`weight_scale_inv`) keeps its
    projections quantized, with the logits of dequantize-on-load."""
    from tests.tiny_checkpoints import build_tiny_qwen4_exp_checkpoint

    source, _ = build_tiny_qwen4_exp_checkpoint(tmp_path / "src", seed=2)
    state = load_file(str(source / "model.safetensors"))
    out = {}
    for name, w in state.items():
        if name.endswith(QWEN_FP8) and w.dim() == 2 and "layers" in name:
            out[name], scale, _ = quantize_fp8_blocks(w, block=BLOCK, e8m0=False)
            out[name + "_scale_inv"] = scale
        else:
            out[name] = w
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    target = tmp_path / "q"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    save_file(out, str(target / "model.safetensors"))
    model = load_model(ModelConfig.from_path(target, "float32"), progress=False)
    found = dict(quantized_modules(model))
    for suffix in ("self_attn.o_proj", "linear_attn.out_proj", "shared_expert.down_proj"):
        assert any(n.endswith(suffix) for n in found), suffix
    torch.testing.assert_close(
        prefill_logits(target, "auto"), prefill_logits(target, "none"), atol=2e-5, rtol=1e-5
    )


def test_tensor_parallel_split_inside_a_scale_block_is_refused(quantized):
    """Rank 1 of TP 2 would start `wo_b`'s inputs at column 12 of 24, inside an 8-column
    scale block (and split each expert's 32 inputs of `w2` into halves of an MXFP4 group):
    refused naming the tensor, not served with shifted scales."""
    from runtime.configs.parallel import ParallelLayout
    from runtime.distributed import Mapping

    _, path = quantized
    mapping = Mapping.for_layout(ParallelLayout(2, 1), 1)
    with pytest.raises(CheckpointError, match=r"cannot keep 'layers\.\d+\.(attn|ffn)\.") as err:
        load_model(ModelConfig.from_path(path, "float32"), mapping=mapping, progress=False)
    assert "whole" in str(err.value)


def test_unknown_quantization_is_refused_by_flag_name():
    from runtime.configs.engine_config import EngineConfig

    with pytest.raises(ValueError, match="--quantization 'int4' is not supported"):
        EngineConfig(quantization="int4").resolve()


@pytest.mark.slow
def test_captured_steps_keep_greedy_tokens(quantized, monkeypatch):
    """Compiled decode steps call the quantized operators as opaque nodes: once they are
    ready, greedy tokens still equal dequantize-on-load's eager ones."""
    from runtime.configs.capture import DISABLE_ENV

    experts, path = quantized
    if experts != "mxfp4":
        pytest.skip("one format is enough for the compile")
    expected = generate(path, "none")
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    engine = Engine(
        model_path=str(path),
        dtype="float32",
        page_size=4,
        max_running_requests=4,
        max_total_tokens=512,
        cuda_graph_bs=[4],
    )
    prompts = [random_ids(n, seed=n).tolist() for n in (5, 13, 21)]
    try:
        engine.generate(input_ids=prompts, sampling_params=GREEDY)  # queues the compile
        graphs = engine.runner.graph_runner
        assert graphs.wait_until_idle(timeout=600)
        ready = [s for s in graphs.compiled_steps() if s[1] == "ready"]
        assert ready, graphs.compiled_steps()
        out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    finally:
        engine.shutdown()
    assert [r["output_ids"] for r in out] == expected


def test_none_reproduces_dequantized_values_exactly(source, quantized, tmp_path):
    """`--quantization none` loads exactly the values the format defines: its logits equal,
    bit for bit, those of a float checkpoint holding the test's own dequantized weights."""
    experts, path = quantized
    state = load_file(str(source / "model.safetensors"))
    dense = {}
    for name, w in state.items():
        if name.endswith(FP8_SUFFIXES + MTP_FP8_SUFFIXES) or (
            experts == "fp8" and is_routed_expert(name)
        ):
            dense[name] = quantize_fp8_blocks(w, block=BLOCK, e8m0=True)[2]
        elif is_routed_expert(name):
            dense[name] = quantize_mxfp4(w)[2]
        else:
            dense[name] = w
    reference = tmp_path / "dense"
    reference.mkdir()
    (reference / "config.json").write_text((source / "config.json").read_text())
    save_file(dense, str(reference / "model.safetensors"))
    assert torch.equal(prefill_logits(path, "none"), prefill_logits(reference, "auto"))
