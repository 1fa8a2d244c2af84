# SPDX-License-Identifier: Apache-2.0
"""The DeepSeek-V4 family of the tiny-model trainer (`python -m training.train_tiny_model`):
a tiny DeepSeek-V4 trunk (transformers' modules, training mode, no cache) and one MTP layer
whose math is exactly the runtime's draft (runtime/models/deepseek_v4_mtp.py):

    e = enorm(embed(t_{i+1}))  (zero at position 0)
    x = h_proj(hnorm(h_i)) + e_proj(e)       h_i: trunk streams before hc_head, [hc, H]
    x = V4 decoder block (window-only attention, learned routing)
    logits_i = head(norm(hc_head(x)))        predicts t_{i+2}

plus the released checkpoint names, the router balancing and the model card's
family-specific lines. Its checkpoint is the runtime's embedded default model.
"""

from __future__ import annotations

import argparse
import copy
import re
import tempfile
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.deepseek_v4 import hf_to_released_name
from training import REPO_ROOT

NAME = "deepseek_v4"
MODEL_TYPE = "deepseek_v4"
HF_CLASS_NAME = "DeepseekV4ForCausalLM"
DEFAULT_OUTPUT = REPO_ROOT / "runtime" / "assets" / "deepseek_v4_tiny"
DEFAULT_WORK_DIR = Path(tempfile.gettempdir()) / "train_tiny_model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model shape and the family's own optimisation flags."""
    shape = parser.add_argument_group("shape")
    shape.add_argument("--hidden-size", type=int, default=256)
    shape.add_argument("--num-layers", type=int, default=8)
    shape.add_argument("--num-heads", type=int, default=8)
    shape.add_argument("--head-dim", type=int, default=64)
    shape.add_argument("--rope-dim", type=int, default=32)
    shape.add_argument("--q-lora-rank", type=int, default=128)
    shape.add_argument("--o-groups", type=int, default=4)
    shape.add_argument("--o-lora-rank", type=int, default=64)
    shape.add_argument("--sliding-window", type=int, default=128)
    shape.add_argument("--hca-rate", type=int, default=16)
    shape.add_argument("--index-heads", type=int, default=16)
    shape.add_argument("--index-head-dim", type=int, default=32)
    shape.add_argument("--index-topk", type=int, default=32)
    shape.add_argument("--num-experts", type=int, default=8)
    shape.add_argument("--experts-per-token", type=int, default=2)
    shape.add_argument("--moe-intermediate-size", type=int, default=128)
    shape.add_argument("--num-hash-layers", type=int, default=2)
    shape.add_argument("--hc-mult", type=int, default=4)
    shape.add_argument("--max-positions", type=int, default=2048)
    parser.add_argument_group("deepseek_v4 optimisation").add_argument(
        "--bias-update-rate",
        type=float,
        default=1e-3,
        help="router balancing bias step per training step",
    )


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------


def layer_schedule(num_layers: int) -> list[str]:
    """Window-only first layers, then CSA / HCA alternating (DeepSeek-V4-Flash's pattern)."""
    head = min(num_layers, 2 if num_layers >= 6 else 1)
    kinds = ["compressed_sparse_attention", "heavily_compressed_attention"]
    return ["sliding_attention"] * head + [kinds[i % 2] for i in range(num_layers - head)]


def model_config(args: argparse.Namespace, vocab_size: int, token_ids: dict[str, int]) -> dict:
    """The checkpoint's config.json (HF `DeepseekV4Config` keys plus the released ones)."""
    hidden = args.hidden_size
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": 1,
        "head_dim": args.head_dim,
        "qk_rope_head_dim": args.rope_dim,
        "q_lora_rank": args.q_lora_rank,
        "o_groups": args.o_groups,
        "o_lora_rank": args.o_lora_rank,
        "sliding_window": args.sliding_window,
        "layer_types": layer_schedule(args.num_layers),
        "compress_rates": {
            "compressed_sparse_attention": 4,
            "heavily_compressed_attention": args.hca_rate,
        },
        "compress_rope_theta": 160000.0,
        "rope_theta": 10000.0,
        # YaRN on the compressed layers as in V4, stretched from the training length.
        "rope_scaling": {
            "type": "yarn",
            "factor": args.max_positions / args.seq_len,
            "original_max_position_embeddings": args.seq_len,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": args.max_positions,
        "index_n_heads": args.index_heads,
        "index_head_dim": args.index_head_dim,
        "index_topk": args.index_topk,
        "num_hash_layers": min(args.num_hash_layers, args.num_layers),
        "n_routed_experts": args.num_experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": args.experts_per_token,
        "moe_intermediate_size": args.moe_intermediate_size,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "hc_mult": args.hc_mult,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1,
        "bos_token_id": token_ids["bos"],
        "eos_token_id": token_ids["eos"],
        "pad_token_id": token_ids["pad"],
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    }


def hf_config(config: dict, extra_layers: int = 0):
    """A transformers `DeepseekV4Config`, optionally with window-only layers appended (the
    MTP block is layer `num_hidden_layers` of such a config, as in the released layout)."""
    from transformers import DeepseekV4Config

    # A deep copy: the config class fills defaults into nested dicts (rope_scaling) in place.
    config = {
        k: copy.deepcopy(v) for k, v in config.items() if k not in ("architectures", "model_type")
    }
    if extra_layers:
        config["num_hidden_layers"] += extra_layers
        config["layer_types"] = config["layer_types"] + ["sliding_attention"] * extra_layers
    hf = DeepseekV4Config(**config)
    hf._attn_implementation = "eager"  # V4 ships eager attention only
    hf._experts_implementation = "eager"  # also for the stand-alone MTP block
    return hf


class MTPLayer(nn.Module):
    """The MTP (NextN) layer in training form: a transformers decoder block at layer index
    `num_hidden_layers` plus the MTP's own projections, norms and hc_head."""

    def __init__(self, config: dict):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
            DeepseekV4DecoderLayer,
            DeepseekV4HyperHead,
            DeepseekV4RMSNorm,
        )

        super().__init__()
        plus = hf_config(config, extra_layers=1)
        hidden, eps = plus.hidden_size, plus.rms_norm_eps
        self.enorm = DeepseekV4RMSNorm(hidden, eps)
        self.hnorm = DeepseekV4RMSNorm(hidden, eps)
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.block = DeepseekV4DecoderLayer(plus, config["num_hidden_layers"])
        self.hc_head = DeepseekV4HyperHead(plus)
        self.norm = DeepseekV4RMSNorm(hidden, eps)

    def forward(
        self,
        streams: torch.Tensor,
        next_embeds: torch.Tensor,
        rope: dict,
        positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """`streams [B, S, hc, H]`, `next_embeds [B, S, H]` (embedding of t_{i+1}) -> the
        block's output streams `X [B, S, hc, H]`, what a chained draft step reads as its `h`
        (runtime/models/deepseek_v4_mtp.py); `head_hidden(X)` feeds the shared head."""
        next_embeds = next_embeds.masked_fill((positions == 0).view(1, -1, 1), 0)
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(next_embeds)).unsqueeze(2)
        return self.block(
            x, position_embeddings=rope, position_ids=positions.unsqueeze(0), attention_mask=mask
        )

    def head_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.hc_head(x))


class TinyV4(nn.Module):
    """Trunk (`DeepseekV4ForCausalLM`) + one MTP layer sharing its embedding and head."""

    def __init__(self, config: dict, seed: int):
        from transformers import DeepseekV4ForCausalLM

        super().__init__()
        self.config = config
        torch.manual_seed(seed)
        self.trunk = DeepseekV4ForCausalLM(hf_config(config)).float()
        self.mtp = MTPLayer(config).float()
        self.mtp.apply(self.trunk._init_weights)  # the trunk's init scheme for the MTP too
        init_hash_routing_(self.trunk, torch.Generator().manual_seed(seed + 1))
        use_fast_hyper_connections_(self)
        self._streams: torch.Tensor | None = None
        self.detach_streams = False  # True: no MTP gradient into the trunk
        self.trunk.model.layers[-1].register_forward_hook(self._keep_streams)

    def _keep_streams(self, module, inputs, output):
        self._streams = output  # the last layer's output: the streams before hc_head

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`tokens [B, S + 2]` -> (trunk logits `[B, S, V]` for t_{i+1},
        MTP logits `[B, S, V]` for t_{i+2})."""
        seq = tokens.shape[1] - 2
        inputs, next_ids = tokens[:, :seq], tokens[:, 1 : seq + 1]
        trunk_logits = self.trunk(input_ids=inputs, use_cache=False).logits
        streams, self._streams = self._streams, None
        if self.detach_streams:
            streams = streams.detach()
        model = self.trunk.model
        positions = torch.arange(seq, device=tokens.device)
        rope = self._ropes(streams, positions)
        mask = sliding_window_mask(seq, self.config["sliding_window"], tokens.device)
        x = self.mtp(streams, model.embed_tokens(next_ids), rope, positions, mask)
        return trunk_logits, self.trunk.lm_head(self.mtp.head_hidden(x))

    def _ropes(self, like: torch.Tensor, positions: torch.Tensor) -> dict:
        rotary = self.trunk.model.rotary_emb
        return {
            kind: rotary(like, positions.unsqueeze(0), layer_type=kind)
            for kind in ("main", "compress")
        }

    def chained_draft(self, tokens: torch.Tensor, passes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP run as the runtime chains it, `passes` draft steps from every row at once
        (HASS / EAGLE-3's training-time test): `tokens [B, S + 2]` -> (the frozen trunk's
        logits `[B, S + 1, V]` over `tokens[:, :S + 1]`, draft logits `[B, passes, S, V]`).

        Pass 0 is the MTP over the trunk's streams, as `forward`. Row r of pass k > 0 reads
        pass k-1's output streams at row r-1 and the embedding of t_{r+1} (teacher forcing),
        and attends to pass-0 rows up to r-k and to its own chain's rows r-k+1..r: the keys a
        runtime draft step at position r sees when the verified rows end at r-k (every
        cached draft row comes from the target's streams, the chain's rows from the draft's
        own). The block runs once per pass over all passes so far (`chain_mask`)."""
        seq = tokens.shape[1] - 2
        with torch.no_grad():
            trunk_logits = self.trunk(input_ids=tokens[:, : seq + 1], use_cache=False).logits
            streams, self._streams = self._streams[:, :seq], None
        embeds = self.trunk.model.embed_tokens(tokens[:, 1 : seq + 1])
        inputs = [streams]
        for k in range(passes):
            positions = torch.arange(seq, device=tokens.device).repeat(k + 1)
            mask = chain_mask(seq, k + 1, self.config["sliding_window"], tokens.device)
            x = self.mtp(
                torch.cat(inputs, 1), embeds.repeat(1, k + 1, 1),
                self._ropes(streams, positions), positions, mask,
            )  # fmt: skip
            newest = x[:, k * seq :]
            inputs.append(F.pad(newest[:, :-1], (0, 0, 0, 0, 1, 0)))  # row r reads row r-1
        logits = self.trunk.lm_head(self.mtp.head_hidden(x))
        return trunk_logits, logits.unflatten(1, (passes, seq))


TinyModel = TinyV4  # the name the driver builds every family's model by


def sinkhorn_tokens_last(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """mHC's Sinkhorn (runtime/layers/hyper_connection.py::sinkhorn) on `[hc, hc, N]`: rows
    are dim 0, columns dim 1, tokens last, so each of the ~80 reductions is a few long
    vector adds instead of a strided reduction over 4 elements (the same math; the Sinkhorn
    share of a training step's CPU time drops from about a fifth to a few percent)."""
    comb = torch.softmax(logits, dim=1) + eps
    comb = comb / (comb.sum(dim=0, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=0, keepdim=True) + eps)
    return comb


def fast_hyper_connection_forward(self, hidden_streams: torch.Tensor):
    """Drop-in `DeepseekV4HyperConnection.forward` (transformers) with the Sinkhorn done
    tokens-last; returns the same `(post, comb, collapsed)`."""
    batch, seq = hidden_streams.shape[:2]
    hc = self.hc_mult
    mixes = F.linear(self.input_norm(hidden_streams.view(batch, seq, -1).float()), self.fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
    pre_scale, post_scale, comb_scale = self.scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    logits = (comb_w * comb_scale + comb_b).reshape(-1, hc, hc).permute(1, 2, 0)
    comb = sinkhorn_tokens_last(logits, self.hc_sinkhorn_iters, self.hc_eps)
    comb = comb.permute(2, 0, 1).reshape(batch, seq, hc, hc).contiguous()
    collapsed = (pre.unsqueeze(-1) * hidden_streams).sum(dim=2).to(hidden_streams.dtype)
    return post, comb, collapsed


def use_fast_hyper_connections_(model: nn.Module) -> None:
    """Route every mHC module of `model` through `fast_hyper_connection_forward`."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    for module in model.modules():
        if isinstance(module, DeepseekV4HyperConnection):
            module.forward = types.MethodType(fast_hyper_connection_forward, module)


def sliding_window_mask(seq: int, window: int, device) -> torch.Tensor:
    """Additive causal mask `[1, 1, S, S]`: key k is visible to query q iff q-window < k <= q."""
    q = torch.arange(seq, device=device).view(-1, 1)
    k = torch.arange(seq, device=device).view(1, -1)
    visible = (k <= q) & (k > q - window)
    mask = torch.zeros(seq, seq, device=device).masked_fill(~visible, float("-inf"))
    return mask.view(1, 1, seq, seq)


def chain_mask(seq: int, passes: int, window: int, device) -> torch.Tensor:
    """Additive mask `[1, 1, P*S, P*S]` over `passes` copies of S rows (row j*S + r is row r
    of pass j). A query of pass k at row r sees pass-0 keys at rows up to r-k and the key of
    pass j at row r-(k-j) for 0 < j <= k, all within the window: pass 0 alone is
    `sliding_window_mask`."""
    row = torch.arange(seq, device=device).repeat(passes)
    step = torch.arange(passes, device=device).repeat_interleave(seq)
    q_row, q_step = row.view(-1, 1), step.view(-1, 1)
    k_row, k_step = row.view(1, -1), step.view(1, -1)
    cached = (k_step == 0) & (k_row <= q_row - q_step)
    chained = (k_step > 0) & (k_step <= q_step) & (k_row == q_row - (q_step - k_step))
    visible = (cached | chained) & (k_row > q_row - window)
    mask = torch.zeros(visible.shape, device=device).masked_fill(~visible, float("-inf"))
    return mask.view(1, 1, *visible.shape)


def init_hash_routing_(trunk: nn.Module, generator: torch.Generator) -> None:
    """Hash layers route by a frozen token -> experts table; transformers leaves it zero
    (the real one comes from the checkpoint), so draw one: distinct experts per token."""
    for layer in trunk.model.layers:
        gate = layer.mlp.gate
        if hasattr(gate, "tid2eid"):
            vocab, top_k = gate.tid2eid.shape
            scores = torch.rand(vocab, gate.num_experts, generator=generator)
            gate.tid2eid.copy_(scores.argsort(dim=-1)[:, :top_k])


class ExpertBalancer:
    """Auxiliary-loss-free load balancing (DeepSeek-V3/V4): after each step, nudge every
    learned router's selection bias toward under-loaded experts."""

    def __init__(self, model: nn.Module, rate: float):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV4TopKRouter)]
        self.loads = {id(r): torch.zeros(r.num_experts) for r in self.routers}
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router, inputs, output):
        if router.training:
            indices = output[2]
            counts = torch.bincount(indices.flatten(), minlength=router.num_experts)
            self.loads[id(router)] += counts

    def loss(self) -> None:
        return None  # balancing needs no loss term here

    @torch.no_grad()
    def update(self) -> None:
        for router in self.routers:
            load = self.loads[id(router)]
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            load.zero_()


def make_balancer(model: nn.Module, args) -> ExpertBalancer:
    return ExpertBalancer(model, args.bias_update_rate)


# ---------------------------------------------------------------------------------------
# Released checkpoint names
# ---------------------------------------------------------------------------------------

# Released dtypes: the mHC mixers, sinks, compressor position biases and router biases are
# F32, the hash table I64, everything else BF16.
_F32_SUFFIXES = (
    "hc_attn_fn",
    "hc_attn_base",
    "hc_attn_scale",
    "hc_ffn_fn",
    "hc_ffn_base",
    "hc_ffn_scale",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
    "attn_sink",
    ".ape",
    "gate.bias",
)


def _expert_split(name: str, tensor: torch.Tensor, intermediate: int):
    """transformers' fused routed experts -> released per-expert (name, tensor) pairs."""
    if name.endswith("mlp.experts.gate_up_proj"):
        prefix = hf_to_released_name(name.removesuffix(".experts.gate_up_proj") + ".x")[:-2]
        for e in range(tensor.shape[0]):
            yield f"{prefix}.experts.{e}.w1.weight", tensor[e, :intermediate]
            yield f"{prefix}.experts.{e}.w3.weight", tensor[e, intermediate:]
    else:
        prefix = hf_to_released_name(name.removesuffix(".experts.down_proj") + ".x")[:-2]
        for e in range(tensor.shape[0]):
            yield f"{prefix}.experts.{e}.w2.weight", tensor[e]


def _released_items(hf_state: dict[str, torch.Tensor], intermediate: int):
    for name, tensor in hf_state.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            yield from _expert_split(name, tensor, intermediate)
        else:
            yield hf_to_released_name(name), tensor


def _mtp_hf_state(model: TinyV4) -> dict[str, torch.Tensor]:
    """The MTP's tensors under transformers names of a trunk one layer deeper, with the
    layer-level extras under their released names (they have no transformers spelling)."""
    mtp, n = model.mtp, model.config["num_hidden_layers"]
    state = {f"model.layers.{n}.{k}": v for k, v in mtp.block.state_dict().items()}
    state.update(
        {
            "mtp.0.enorm.weight": mtp.enorm.weight,
            "mtp.0.hnorm.weight": mtp.hnorm.weight,
            "mtp.0.e_proj.weight": mtp.e_proj.weight,
            "mtp.0.h_proj.weight": mtp.h_proj.weight,
            "mtp.0.norm.weight": mtp.norm.weight,
            "mtp.0.hc_head_fn": mtp.hc_head.hc_fn,
            "mtp.0.hc_head_base": mtp.hc_head.hc_base,
            "mtp.0.hc_head_scale": mtp.hc_head.hc_scale,
        }
    )
    return state


def released_state_dict(model: TinyV4) -> dict[str, torch.Tensor]:
    """The whole model in the released DeepSeek-V4 naming and dtypes (`mtp.0.*` included)."""
    intermediate, n = model.config["moe_intermediate_size"], model.config["num_hidden_layers"]
    out = dict(_released_items(model.trunk.state_dict(), intermediate))
    for name, tensor in _released_items(_mtp_hf_state(model), intermediate):
        out[re.sub(rf"^layers\.{n}\.", "mtp.0.", name)] = tensor
    return {name: _released_dtype(name, t).contiguous() for name, t in out.items()}


def _released_dtype(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point():
        return tensor.detach().clone()
    dtype = torch.float32 if name.endswith(_F32_SUFFIXES) else torch.bfloat16
    return tensor.detach().to(dtype).clone()


def load_released_state_(model: TinyV4, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `released_state_dict`: fill `model` from a released-naming checkpoint."""
    intermediate, n = model.config["moe_intermediate_size"], model.config["num_hidden_layers"]

    def fill(hf_state: dict[str, torch.Tensor], rename) -> None:
        for name, param in hf_state.items():
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                parts = [tensors[rename(k)] for k, _ in _expert_split(name, param, intermediate)]
                if name.endswith("gate_up_proj"):  # (w1, w3) pairs, stacked [gate; up]
                    parts = [torch.cat(parts[i : i + 2]) for i in range(0, len(parts), 2)]
                value = torch.stack(parts)
            else:
                value = tensors[rename(hf_to_released_name(name))]
            param.data.copy_(value.to(param.dtype))

    fill(model.trunk.state_dict(), lambda k: k)
    fill(_mtp_hf_state(model), lambda k: re.sub(rf"^layers\.{n}\.", "mtp.0.", k))


def hf_causal_lm():
    """The transformers class the evaluation loads the checkpoint with (ignores `mtp.*`)."""
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM


def training_summary(args, model: nn.Module) -> dict:
    return {}


# ---------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------


def _attention_summary(config: dict) -> str:
    kinds = {
        "sliding_attention": "W",
        "compressed_sparse_attention": "C",
        "heavily_compressed_attention": "H",
    }
    return "".join(kinds[t] for t in config["layer_types"])


def card_introduction(config: dict) -> list[str]:
    return [
        "# deepseek_v4_tiny: the embedded default model of nextn-runtime",
        "",
        "A tiny DeepSeek-V4 with one MTP (NextN) layer, trained from scratch on CPU by",
        "`training/train_tiny_model.py` on the Python standard library. It exists so that the",
        "runtime serves something by default and NEXTN speculative decoding has drafts worth",
        "accepting. It continues Python source with Python-looking text, often repetitive",
        "(an hour of CPU training); it is not an assistant (the chat template only frames",
        "messages, the model never saw chat data) and knows nothing but the standard library.",
    ]


def card_architecture(config: dict, params: dict, size_mb: float) -> list[str]:
    rates = config["compress_rates"]
    return [
        f"| layers | {config['num_hidden_layers']} (+1 MTP), attention "
        f"`{_attention_summary(config)}` "
        f"(W window-only, C CSA rate {rates['compressed_sparse_attention']} with indexer, "
        f"H HCA rate {rates['heavily_compressed_attention']}) |",
        f"| hidden / mHC streams | {config['hidden_size']} / {config['hc_mult']} |",
        f"| attention | {config['num_attention_heads']} query heads of {config['head_dim']} "
        f"(RoPE on {config['qk_rope_head_dim']}), one shared KV latent, q rank "
        f"{config['q_lora_rank']}, {config['o_groups']} output groups of rank "
        f"{config['o_lora_rank']}, window {config['sliding_window']} |",
        f"| indexer | {config['index_n_heads']} heads of {config['index_head_dim']}, "
        f"top-{config['index_topk']} |",
        f"| MoE | {config['n_routed_experts']} routed experts "
        f"(top-{config['num_experts_per_tok']}, "
        f"width {config['moe_intermediate_size']}) + 1 shared; first {config['num_hash_layers']} "
        f"layers hash-routed |",
        f"| vocabulary / context | {config['vocab_size']} byte-level BPE / "
        f"{config['max_position_embeddings']} |",
        f"| parameters | {params['total'] / 1e6:.2f} M ({params['trunk'] / 1e6:.2f} M trunk, "
        f"{params['mtp'] / 1e6:.2f} M MTP; embedding and head shared) |",
        f"| file | `model.safetensors`, {size_mb:.1f} MB, released DeepSeek-V4 names "
        "(`mtp.0.*` included), BF16 (mHC mixers, sinks, biases F32) |",
    ]


def card_training_notes(summary: dict) -> list[str]:
    return [
        f"* Loss = CE(next token) + {summary['mtp_weight']:g} x CE(MTP, token after next). "
        + (
            "The MTP reads the trunk streams detached (no MTP gradient into the trunk)."
            if summary["mtp_detach"]
            else "MTP gradients flow into the trunk (as DeepSeek trains it)."
        ),
        "* Routers balance with DeepSeek's auxiliary-loss-free bias update; hash-routed "
        "layers use a fixed random token -> experts table. The indexer is not trained (its "
        "top-k is not differentiable; DeepSeek trains it by distillation): it keeps its "
        "initial weights.",
    ]
