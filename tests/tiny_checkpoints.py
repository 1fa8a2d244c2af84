# SPDX-License-Identifier: Apache-2.0
"""Tiny random checkpoints built on the fly, saved in the released DeepSeek-V4 naming.

The weights come from a randomly initialised transformers model (every parameter
re-drawn, so sinks, biases and position biases are not left at zero), renamed to the
released checkpoint names and written with safetensors. transformers loads the same
directory through its own conversion table, which makes it an independent oracle for
our name mapping as well as for the numerics.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from runtime.models.deepseek_v4 import hf_to_released_name


def tiny_v4_config(**overrides) -> dict:
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": 97,
        "hidden_size": 32,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "qk_rope_head_dim": 8,
        "q_lora_rank": 24,
        "o_groups": 2,
        "o_lora_rank": 12,
        "sliding_window": 8,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "num_hash_layers": 1,
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 3,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 1024,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def _randomise_(model: torch.nn.Module, generator: torch.Generator, num_experts: int) -> None:
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name:
            continue
        if name.endswith("tid2eid"):
            rows = [
                torch.randperm(num_experts, generator=generator)[: tensor.shape[1]]
                for _ in range(tensor.shape[0])
            ]
            tensor.data.copy_(torch.stack(rows))
            continue
        noise = torch.randn(tensor.shape, generator=generator)
        if name.endswith(("norm.weight", "layernorm.weight", "kv_norm.weight", "q_a_norm.weight")):
            value = 1.0 + 0.1 * noise
        elif name.endswith(("scale", "hc_scale")):
            value = 1.0 + 0.2 * noise
        elif name.endswith(
            ("sinks", "base", "hc_base", "position_bias", "e_score_correction_bias")
        ):
            value = 0.3 * noise
        elif name.endswith(("fn", "hc_fn")):
            value = 0.1 * noise
        else:
            fan_in = tensor.shape[-1]
            value = noise / fan_in**0.5
        tensor.data.copy_(value)


def released_state_dict(
    hf_state: dict[str, torch.Tensor], intermediate: int
) -> dict[str, torch.Tensor]:
    """transformers names -> released names, routed experts split per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = hf_to_released_name(name.removesuffix(".experts.gate_up_proj") + ".x")[:-2]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.experts.{e}.w1.weight"] = tensor[e, :intermediate].clone()
                out[f"{prefix}.experts.{e}.w3.weight"] = tensor[e, intermediate:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = hf_to_released_name(name.removesuffix(".experts.down_proj") + ".x")[:-2]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.experts.{e}.w2.weight"] = tensor[e].clone()
        else:
            out[hf_to_released_name(name)] = tensor.clone().contiguous()
    return out


def make_hf_v4_model(config: dict, seed: int = 0):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_config = DeepseekV4Config(
        **{k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    )
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hf_config).float().eval()
    _randomise_(model, torch.Generator().manual_seed(seed), hf_config.n_routed_experts)
    return model


def save_released_checkpoint(
    path: Path, config: dict, state: dict[str, torch.Tensor], num_shards: int = 1
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(state)
    if num_shards == 1:
        save_file(state, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: state[n] for n in names[shard::num_shards]}
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return path


def build_tiny_v4_checkpoint(path: Path, seed: int = 0, num_shards: int = 1, **overrides):
    """Writes a released-named checkpoint; returns (path, the transformers model it came from)."""
    config = tiny_v4_config(**overrides)
    model = make_hf_v4_model(config, seed)
    state = released_state_dict(model.state_dict(), config["moe_intermediate_size"])
    return save_released_checkpoint(path, config, state, num_shards), model


def mtp_state(config: dict, seed: int) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """Random `mtp.0.*` tensors in the released naming, and the transformers model whose last
    decoder layer is the MTP block (the dense oracle reuses it)."""
    num_layers = config["num_hidden_layers"]
    plus = {
        **config,
        "num_hidden_layers": num_layers + 1,
        "layer_types": list(config["layer_types"]) + ["sliding_attention"],
    }
    model = make_hf_v4_model(plus, seed + 100)
    released = released_state_dict(model.state_dict(), config["moe_intermediate_size"])
    prefix = f"layers.{num_layers}."
    state = {"mtp.0." + k[len(prefix) :]: v for k, v in released.items() if k.startswith(prefix)}
    g = torch.Generator().manual_seed(seed + 200)
    hidden, hc = config["hidden_size"], config["hc_mult"]

    def noise(*shape):
        return torch.randn(shape, generator=g)

    state.update(
        {
            "mtp.0.enorm.weight": 1 + 0.1 * noise(hidden),
            "mtp.0.hnorm.weight": 1 + 0.1 * noise(hidden),
            "mtp.0.norm.weight": 1 + 0.1 * noise(hidden),
            "mtp.0.e_proj.weight": noise(hidden, hidden) / hidden**0.5,
            "mtp.0.h_proj.weight": noise(hidden, hidden) / hidden**0.5,
            "mtp.0.hc_head_fn": 0.1 * noise(hc, hc * hidden),
            "mtp.0.hc_head_base": 0.3 * noise(hc),
            "mtp.0.hc_head_scale": 1 + 0.2 * noise(1),
        }
    )
    return state, model


def build_tiny_v4_mtp_checkpoint(path: Path, seed: int = 0, num_shards: int = 1, **overrides):
    """A tiny V4 target plus one random MTP layer. Returns (path, target hf model, mtp hf model)."""
    config = tiny_v4_config(**overrides)
    target = make_hf_v4_model(config, seed)
    state = released_state_dict(target.state_dict(), config["moe_intermediate_size"])
    extra, mtp_model = mtp_state(config, seed)
    state.update(extra)
    return save_released_checkpoint(path, config, state, num_shards), target, mtp_model


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_char_tokenizer(path: Path, vocab_size: int) -> None:
    """A character-level tokenizer the size of the tiny vocabulary: ids 0-2 are
    <bos>/<eos>/<pad>, then one id per character; saved for `AutoTokenizer`."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = (" " + string.ascii_letters + string.digits + "!\"#$%&'()*+,-./:;<=>?@[\\]^_{|}~")[
        : vocab_size - 3
    ]
    vocab = {"<bos>": 0, "<eos>": 1, "<pad>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


# ---------------------------------------------------------------------------------------
# Qwen4Exp


def tiny_qwen4_exp_config(**overrides) -> dict:
    config = {
        "architectures": ["Qwen4ExpForCausalLM"],
        "model_type": "qwen4_exp_text",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layer_types": [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "output_gate_type": "sigmoid",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "norm_topk_prob": True,
        "hc_count": 4,
        "hc_lowrank": 8,
        "indexer_n_heads": 8,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
        "ple_layer_ids": [2],
        "ple_embed_dim": 64,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": 1000,
        "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 1,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "mtp_num_hidden_layers": 1,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def _randomise_qwen_(model: torch.nn.Module, generator: torch.Generator) -> None:
    for name, tensor in list(model.named_parameters()):
        noise = torch.randn(tensor.shape, generator=generator)
        if "norm" in name and name.endswith("weight") and "linear_attn.norm" not in name:
            value = 0.1 * noise  # (1 + w) norms
        elif "linear_attn.norm" in name:
            value = 1.0 + 0.1 * noise
        elif name.endswith("A_log"):
            value = torch.rand(tensor.shape, generator=generator).mul(3).add(0.01).log()
        elif name.endswith("dt_bias"):
            value = 0.5 * noise
        elif "ngram_embedding" in name or name.endswith("embed_tokens.weight"):
            value = noise
        else:
            value = noise / tensor.shape[-1] ** 0.5
        tensor.data.copy_(value)


def make_hf_qwen4_exp_model(config: dict, seed: int = 0):
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    hf_config = Qwen4ExpTextConfig(
        **{
            k: v
            for k, v in config.items()
            if k not in ("architectures", "model_type", "mtp_num_hidden_layers")
        }
    )
    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(hf_config).float().eval()
    _randomise_qwen_(model, torch.Generator().manual_seed(seed))
    return model


def build_tiny_qwen4_exp_checkpoint(path: Path, seed: int = 0, **overrides):
    """transformers-named Qwen4Exp text checkpoint; returns (path, the transformers model)."""
    config = tiny_qwen4_exp_config(**overrides)
    model = make_hf_qwen4_exp_model(config, seed)
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    return save_released_checkpoint(path, config, state), model


def qwen_mtp_state(config: dict, seed: int) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """The 31 `mtp.*` tensors of a Qwen4Exp checkpoint (released names), and the
    transformers model whose last decoder layer is the MTP layer (for the dense oracle)."""
    layers = config["num_hidden_layers"]
    plus = {
        **config,
        "num_hidden_layers": layers + 1,
        "layer_types": list(config["layer_types"]) + ["full_attention"],
    }
    model = make_hf_qwen4_exp_model(plus, seed + 100)
    prefix = f"model.layers.{layers}."
    state = {
        "mtp.layers.0." + k[len(prefix) :]: v.clone()
        for k, v in model.state_dict().items()
        if k.startswith(prefix)
    }
    g = torch.Generator().manual_seed(seed + 200)
    hidden, n, r = config["hidden_size"], config["hc_count"], config["hc_lowrank"]

    def noise(*shape, scale=1.0):
        return scale * torch.randn(shape, generator=g)

    state.update(
        {
            "mtp.fc_embedding.weight": noise(hidden, hidden, scale=hidden**-0.5),
            "mtp.fc_hidden.weight": noise(hidden, hidden, scale=hidden**-0.5),
            "mtp.pre_fc_norm_embedding.weight": noise(hidden, scale=0.1),
            "mtp.pre_fc_norm_hidden.weight": noise(n * hidden, scale=0.1),
            "mtp.hyper_connection_mixer.hc_norm.weight": noise(n * hidden, scale=0.1),
            "mtp.hyper_connection_mixer.input_mix_weight_down.weight": noise(
                r, n * hidden, scale=(n * hidden) ** -0.5
            ),
            "mtp.hyper_connection_mixer.input_mix_weight_up.weight": noise(
                n * hidden, r, scale=r**-0.5
            ),
        }
    )
    return state, model


def build_tiny_qwen4_exp_mtp_checkpoint(path: Path, seed: int = 0, **overrides):
    """Target + one MTP layer. Returns (path, target hf model, hf model holding the MTP layer)."""
    config = tiny_qwen4_exp_config(**overrides)
    target = make_hf_qwen4_exp_model(config, seed)
    state = {k: v.clone().contiguous() for k, v in target.state_dict().items()}
    extra, mtp_model = qwen_mtp_state(config, seed)
    state.update(extra)
    return save_released_checkpoint(path, config, state), target, mtp_model


def build_tied_checkpoint(family: str, path: Path, seed: int = 0, mtp: bool = True, **overrides):
    """A tiny model of `family` ("deepseek_v4" or "qwen4_exp") with `tie_word_embeddings`,
    written by transformers' `save_pretrained`, which leaves `lm_head.weight` out (the head
    is the embedding); with `mtp`, one random MTP layer in a file of its own beside it.
    Returns (path, the transformers target model)."""
    if family == "deepseek_v4":
        config = tiny_v4_config(tie_word_embeddings=True, **overrides)
        model, draft = make_hf_v4_model(config, seed), mtp_state
    else:
        config = tiny_qwen4_exp_config(tie_word_embeddings=True, **overrides)
        model, draft = make_hf_qwen4_exp_model(config, seed), qwen_mtp_state
    model.save_pretrained(str(path))
    if mtp:
        # transformers' config drops what it does not model (Qwen4Exp's MTP layer count)
        saved = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **saved}, indent=2))
        save_file(draft(config, seed)[0], str(path / "mtp.safetensors"))
    return path, model
