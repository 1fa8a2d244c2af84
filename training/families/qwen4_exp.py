# SPDX-License-Identifier: Apache-2.0
"""The Qwen4Exp family of the tiny-model trainer (`python -m training.train_tiny_model`): a
tiny Qwen4Exp trunk (transformers' modules, training mode, no cache: Gated DeltaNet and QSA
attention layers, gated residual streams, MoE with a shared expert, PLE) and one MTP layer
whose math is exactly the runtime's draft (runtime/models/qwen4_exp_mtp.py, after the
released checkpoint's `mtp.*` module):

    u = fc_embedding(pre_fc_norm_embedding(embed(t_{i+1})))          [H]
    S = fc_hidden(pre_fc_norm_hidden(R_i)) per stream                   one norm over all n*H
    R = DecoderLayer(S_j + u for every stream j)                        full attention + QSA, no PLE
    logits_i = head(mixer(R))                                           predicts t_{i+2}

`R_i` is the trunk's streams before its final mixer, `[n*H]`. The checkpoint keeps the
released text names: transformers' (fused routed experts, the PLE n-gram table in
`split_ngram_parts` shards) plus the 31 `mtp.*` tensors.
"""

from __future__ import annotations

import argparse
import copy
import math
import tempfile
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

NAME = "qwen4_exp"
MODEL_TYPE = "qwen4_exp_text"
HF_CLASS_NAME = "AutoModelForCausalLM"
DEFAULT_OUTPUT = Path(tempfile.gettempdir()) / "qwen4_exp_tiny"
DEFAULT_WORK_DIR = Path(tempfile.gettempdir()) / "train_tiny_model_qwen4_exp"
NGRAM_TABLE = "ple_embedding.ngram_embedding.weight"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model shape and the family's own optimisation flags."""
    shape = parser.add_argument_group("shape")
    shape.add_argument("--hidden-size", type=int, default=256)
    shape.add_argument("--num-layers", type=int, default=8)
    shape.add_argument(
        "--attention-every",
        type=int,
        default=4,
        help="every k-th layer is QSA attention, the others Gated DeltaNet (released: 4)",
    )
    shape.add_argument("--num-heads", type=int, default=4)
    shape.add_argument("--num-kv-heads", type=int, default=2)
    shape.add_argument("--head-dim", type=int, default=64)
    shape.add_argument("--rope-fraction", type=float, default=0.25, help="partial rotary factor")
    shape.add_argument("--linear-key-heads", type=int, default=2)
    shape.add_argument("--linear-value-heads", type=int, default=4)
    shape.add_argument("--linear-head-dim", type=int, default=64)
    shape.add_argument("--index-heads", type=int, default=4)
    shape.add_argument("--index-head-dim", type=int, default=32)
    shape.add_argument(
        "--index-budget", type=int, default=128, help="QSA tokens kept from complete blocks"
    )
    shape.add_argument("--index-ratio", type=int, default=4, help="QSA block length")
    shape.add_argument("--num-experts", type=int, default=8)
    shape.add_argument("--experts-per-token", type=int, default=2)
    shape.add_argument("--moe-intermediate-size", type=int, default=128)
    shape.add_argument("--shared-expert-intermediate-size", type=int, default=128)
    shape.add_argument("--hc-count", type=int, default=4)
    shape.add_argument("--hc-lowrank", type=int, default=32)
    shape.add_argument(
        "--ple-layers",
        default="2",
        help="one-indexed Gated DeltaNet layers with PLE, comma-separated ('' turns PLE off)",
    )
    shape.add_argument("--ple-embed-dim", type=int, default=256)
    shape.add_argument(
        "--ngram-vocab-base", type=int, default=8192, help="rows per hashed n-gram head (about)"
    )
    shape.add_argument(
        "--ngram-shards", type=int, default=4, help="checkpoint shards of each n-gram table"
    )
    shape.add_argument("--max-positions", type=int, default=2048)
    parser.add_argument_group("qwen4_exp optimisation").add_argument(
        "--router-aux-weight",
        type=float,
        default=0.01,
        help="weight of the load-balancing loss of the softmax routers (0: off)",
    )


def layer_schedule(num_layers: int, attention_every: int) -> list[str]:
    """Gated DeltaNet layers with every k-th one QSA attention (`full_attention`, as the
    released config spells it)."""
    return [
        "full_attention" if (i + 1) % attention_every == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def model_config(args: argparse.Namespace, vocab_size: int, token_ids: dict[str, int]) -> dict:
    """The checkpoint's config.json (HF `Qwen4ExpTextConfig` keys plus `mtp_num_hidden_layers`)."""
    return {
        "architectures": ["Qwen4ExpForCausalLM"],
        "model_type": MODEL_TYPE,
        "vocab_size": vocab_size,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "layer_types": layer_schedule(args.num_layers, args.attention_every),
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "output_gate_type": "sigmoid",  # the released GDN gate; HF would default to silu
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": args.rope_fraction,
        },
        "linear_num_key_heads": args.linear_key_heads,
        "linear_num_value_heads": args.linear_value_heads,
        "linear_key_head_dim": args.linear_head_dim,
        "linear_value_head_dim": args.linear_head_dim,
        "linear_conv_kernel_dim": 4,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.experts_per_token,
        "moe_intermediate_size": args.moe_intermediate_size,
        "shared_expert_intermediate_size": args.shared_expert_intermediate_size,
        "norm_topk_prob": True,
        "hc_count": args.hc_count,
        "hc_lowrank": args.hc_lowrank,
        "indexer_n_heads": args.index_heads,
        "indexer_kv_heads": 1,
        "indexer_head_dim": args.index_head_dim,
        "indexer_budget": args.index_budget,
        "indexer_compress_ratio": args.index_ratio,
        "ple_layer_ids": [int(i) for i in args.ple_layers.split(",") if i.strip()],
        "ple_embed_dim": args.ple_embed_dim,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": args.ngram_vocab_base,
        "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": args.ngram_shards,
        "max_position_embeddings": args.max_positions,
        "mtp_num_hidden_layers": 1,
        "bos_token_id": token_ids["bos"],
        "eos_token_id": token_ids["eos"],  # also where PLE's n-gram context restarts
        "pad_token_id": token_ids["pad"],
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
    }


def hf_config(config: dict, extra_layers: int = 0):
    """A transformers `Qwen4ExpTextConfig`, optionally with attention layers appended (the
    MTP layer is layer `num_hidden_layers` of such a config, as in the released layout)."""
    from transformers import Qwen4ExpTextConfig

    dropped = ("architectures", "model_type", "mtp_num_hidden_layers")
    config = {k: copy.deepcopy(v) for k, v in config.items() if k not in dropped}
    if extra_layers:
        config["num_hidden_layers"] += extra_layers
        config["layer_types"] = config["layer_types"] + ["full_attention"] * extra_layers
    hf = Qwen4ExpTextConfig(**config)
    hf._attn_implementation = "sdpa"  # about a fifth faster than eager for training on CPU
    hf._experts_implementation = "grouped_mm"  # one grouped GEMM, no per-expert Python loop
    return hf


def causal_qsa_indexer_forward(
    self, hidden_states, position_embeddings, attention_mask, past_key_values=None
):
    """Drop-in `Qwen4ExpTextQSAIndexer.forward` (transformers) for whole, unpadded causal
    windows without cache, vectorised over queries (the original loops over every batch row
    and query in Python). Same selection: blocks of `ratio` keys, mean-pooled raw keys normed
    and roped at the block start, scored `sum_h relu(q_h . k_b) / sqrt(d)`, the top
    `budget / ratio` complete visible blocks kept plus the incomplete tail; ties go to the
    older block, as in the runtime's indexer."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    batch, seq, _ = hidden_states.shape
    ratio, dim = self.compress_ratio, self.index_head_dim
    pos = torch.arange(seq, device=hidden_states.device)
    causal = pos.view(1, -1) <= pos.view(-1, 1)
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if past_key_values is not None or not bool((visible == causal).all()):
        raise ValueError("the training-form QSA indexer takes unpadded causal windows, no cache")
    cos, sin = (x[:, -seq:] for x in position_embeddings)
    q, raw_keys = self.index_qk_proj(hidden_states).split([self.index_n_heads * dim, dim], -1)
    q = self.q_layernorm(q.view(batch, seq, -1, dim))
    q = apply_rotary_pos_emb(q, cos=cos, sin=sin, unsqueeze_dim=2)
    blocks = seq // ratio
    pooled = raw_keys[:, : blocks * ratio].unflatten(1, (blocks, ratio)).float().mean(2)
    starts = pos[: blocks * ratio : ratio]
    block_keys = apply_rotary_pos_emb(
        self.k_layernorm(pooled.to(raw_keys.dtype)).unsqueeze(2),
        cos=cos[:, starts],
        sin=sin[:, starts],
        unsqueeze_dim=2,
    ).squeeze(2)
    return _select_blocks(self, q, block_keys, pos, causal)


def _select_blocks(indexer, q, block_keys, pos, causal) -> torch.Tensor:
    """Scores of every complete block for every query -> token mask `[B, 1, S, S]`."""
    ratio, blocks = indexer.compress_ratio, block_keys.shape[1]
    if blocks == 0:  # every key is in the incomplete tail: dense causal attention
        return causal.expand(q.shape[0], 1, -1, -1)
    scores = torch.einsum("bshd,bnd->bshn", q.float(), block_keys.float()).relu().sum(2)
    complete = (pos + 1) // ratio  # complete blocks each query sees
    block_visible = torch.arange(blocks, device=pos.device).view(1, -1) < complete.view(-1, 1)
    scores = (scores / math.sqrt(indexer.index_head_dim)).masked_fill(~block_visible, -math.inf)
    order = scores.sort(dim=-1, descending=True, stable=True).indices[..., : indexer.block_topk]
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True) & block_visible
    in_block = chosen[..., (pos // ratio).clamp_max(blocks - 1)] & (pos < blocks * ratio)
    in_tail = pos.view(1, -1) >= (complete * ratio).view(-1, 1)
    return ((in_block | in_tail) & causal).unsqueeze(1)


def use_causal_qsa_indexers_(model: nn.Module) -> None:
    """Route every QSA indexer of `model` through `causal_qsa_indexer_forward`."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextQSAIndexer

    for module in model.modules():
        if isinstance(module, Qwen4ExpTextQSAIndexer):
            module.forward = types.MethodType(causal_qsa_indexer_forward, module)


def causal_mask(seq: int, device) -> torch.Tensor:
    """Boolean causal mask `[1, 1, S, S]` (True: visible), as sdpa attention takes it."""
    pos = torch.arange(seq, device=device)
    return (pos.view(1, -1) <= pos.view(-1, 1)).view(1, 1, seq, seq)


class MTPLayer(nn.Module):
    """`Qwen4ExpMTP`'s predictor in training form; its state dict keys, prefixed `mtp.`, are
    the released names (`layers.0.*` is a transformers decoder layer at index
    `num_hidden_layers`)."""

    def __init__(self, config: dict):
        from transformers.models.qwen4_exp.modeling_qwen4_exp import (
            Qwen4ExpTextDecoderLayer,
            Qwen4ExpTextGatedResidual,
            Qwen4ExpTextRMSNorm,
        )

        super().__init__()
        plus = hf_config(config, extra_layers=1)
        hidden, eps = plus.hidden_size, plus.rms_norm_eps
        self.hc_count, self.hidden_size = plus.hc_count, hidden
        self.pre_fc_norm_embedding = Qwen4ExpTextRMSNorm(hidden, eps=eps)
        # one norm over all n*H values, not one per stream: the released weight has n*H entries
        self.pre_fc_norm_hidden = Qwen4ExpTextRMSNorm(plus.hc_count * hidden, eps=eps)
        self.fc_embedding = nn.Linear(hidden, hidden, bias=False)
        self.fc_hidden = nn.Linear(hidden, hidden, bias=False)  # shared by every stream
        # the layer index is past the trunk's, so PLE (one-indexed trunk layers) stays off
        self.layers = nn.ModuleList([Qwen4ExpTextDecoderLayer(plus, config["num_hidden_layers"])])
        self.hyper_connection_mixer = Qwen4ExpTextGatedResidual(plus, use_combine=False)

    def forward(
        self, streams: torch.Tensor, next_embeds: torch.Tensor, rope: tuple, mask: torch.Tensor
    ) -> torch.Tensor:
        """`streams [B, S, n*H]` (trunk, before its mixer), `next_embeds [B, S, H]` (embedding
        of t_{i+1}) -> mixer output `[B, S, H]` for the shared head."""
        u = self.fc_embedding(self.pre_fc_norm_embedding(next_embeds))
        per_stream = self.pre_fc_norm_hidden(streams).unflatten(-1, (self.hc_count, -1))
        x = (self.fc_hidden(per_stream) + u.unsqueeze(-2)).flatten(-2)  # embedding as residual
        x = self.layers[0](x, position_embeddings=rope, attention_mask=mask)
        return self.hyper_connection_mixer(x)


class TinyQwen4Exp(nn.Module):
    """Trunk (`Qwen4ExpForCausalLM`) + one MTP layer sharing its embedding and head."""

    def __init__(self, config: dict, seed: int):
        from transformers import Qwen4ExpForCausalLM

        super().__init__()
        self.config = config
        torch.manual_seed(seed)
        self.trunk = Qwen4ExpForCausalLM(hf_config(config)).float()
        self.mtp = MTPLayer(config).float()
        self.mtp.apply(self.trunk._init_weights)  # the trunk's init scheme for the MTP too
        use_causal_qsa_indexers_(self)
        self._streams: torch.Tensor | None = None
        self.detach_streams = False  # True: no MTP gradient into the trunk
        self.trunk.model.hyper_connection_mixer.register_forward_pre_hook(self._keep_streams)

    def _keep_streams(self, module, inputs):
        self._streams = inputs[0]  # the final mixer's input: the streams the MTP reads

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
        positions = torch.arange(seq, device=tokens.device).view(1, 1, -1)  # text: 3 equal axes
        rope = model.rotary_emb(streams, positions)
        mask = causal_mask(seq, tokens.device)
        hidden = self.mtp(streams, model.embed_tokens(next_ids), rope, mask)
        return trunk_logits, self.trunk.lm_head(hidden)


TinyModel = TinyQwen4Exp  # the name the driver builds every family's model by


class RouterBalanceLoss:
    """Load balancing for the softmax top-k routers (Switch Transformer, as Qwen trains its
    MoE): `E * sum_e f_e * P_e` per router, f the share of routed slots, P the mean router
    probability; 1 when balanced. Averaged over routers, scaled by `weight`."""

    def __init__(self, model: nn.Module, weight: float):
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextTopKRouter

        self.weight, self.terms = weight, []
        for module in model.modules():
            if isinstance(module, Qwen4ExpTextTopKRouter):
                module.register_forward_hook(self._record)

    def _record(self, router, inputs, output):
        if router.training and self.weight:
            logits, _, indices = output
            probs = torch.softmax(logits.float(), dim=-1).mean(0)
            share = F.one_hot(indices, router.num_experts).float().mean((0, 1))
            self.terms.append(router.num_experts * (share * probs).sum())

    def loss(self) -> torch.Tensor | None:
        if not self.terms:
            return None
        terms, self.terms = self.terms, []
        return self.weight * torch.stack(terms).mean()

    def update(self) -> None:
        pass  # nothing to adjust after the step: the balance is in the loss


def make_balancer(model: nn.Module, args) -> RouterBalanceLoss:
    return RouterBalanceLoss(model, args.router_aux_weight)


# ---------------------------------------------------------------------------------------
# Released checkpoint names
# ---------------------------------------------------------------------------------------


def _released_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """BF16 for every float (the released checkpoint's dtype); the PLE hash tables stay I64."""
    dtype = torch.bfloat16 if tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(dtype).contiguous().clone()


def _ngram_shard_names(name: str, shards: int) -> list[str]:
    stem = name.removesuffix(".weight")
    return [f"{stem}.shard_{i}.weight" for i in range(shards)]


def _trunk_released_items(name: str, tensor: torch.Tensor, shards: int):
    """One trunk tensor -> released (name, tensor) pairs: the PLE n-gram table splits into
    `split_ngram_parts` row shards, everything else keeps its transformers name."""
    if not name.endswith(NGRAM_TABLE):
        yield name, tensor
        return
    if tensor.shape[0] % shards:
        raise ValueError(f"{tensor.shape[0]} n-gram rows do not split into {shards} shards")
    yield from zip(_ngram_shard_names(name, shards), tensor.chunk(shards), strict=True)


def released_state_dict(model: TinyQwen4Exp) -> dict[str, torch.Tensor]:
    """The whole model in the released Qwen4Exp text naming (`mtp.*` included), BF16."""
    shards = model.config["split_ngram_parts"]
    out = {}
    for name, tensor in model.trunk.state_dict().items():
        out.update(_trunk_released_items(name, tensor, shards))
    out.update({f"mtp.{name}": tensor for name, tensor in model.mtp.state_dict().items()})
    return {name: _released_dtype(tensor) for name, tensor in out.items()}


def load_released_state_(model: TinyQwen4Exp, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `released_state_dict`: fill `model` from a released-naming checkpoint."""
    shards = model.config["split_ngram_parts"]
    trunk = {}
    for name in model.trunk.state_dict():
        if name.endswith(NGRAM_TABLE):
            trunk[name] = torch.cat([tensors[n] for n in _ngram_shard_names(name, shards)])
        else:
            trunk[name] = tensors[name]
    model.trunk.load_state_dict(trunk)
    mtp = {name.removeprefix("mtp."): t for name, t in tensors.items() if name.startswith("mtp.")}
    model.mtp.load_state_dict(mtp)


def hf_causal_lm():
    """The transformers class the evaluation loads the checkpoint with (ignores `mtp.*`)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def training_summary(args, model: TinyQwen4Exp) -> dict:
    ple = sum(p.numel() for n, p in model.trunk.named_parameters() if n.endswith(NGRAM_TABLE))
    return {"router_aux_weight": args.router_aux_weight, "ple_table_params": ple}


# ---------------------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------------------


def _layer_pattern(config: dict) -> str:
    ple = set(config["ple_layer_ids"])
    return "".join(
        ("A" if kind != "linear_attention" else "L") + ("+" if i + 1 in ple else "")
        for i, kind in enumerate(config["layer_types"])
    )


def card_introduction(config: dict) -> list[str]:
    return [
        "# qwen4_exp_tiny: a tiny Qwen4Exp with MTP for nextn-runtime",
        "",
        "A tiny Qwen4Exp (the architecture of Qwen3.8-Flash-Next) with one MTP layer, trained",
        "from scratch on CPU by `python -m training.train_tiny_model --family qwen4_exp` on the",
        "Python standard library, so that NEXTN speculative decoding of the Qwen4Exp family",
        "can be served and measured with drafts worth accepting. It continues Python source with",
        "Python-looking text, often repetitive (minutes of CPU training); it is not an",
        "assistant (the chat template only frames messages) and knows nothing but the",
        "standard library.",
    ]


def card_architecture(config: dict, params: dict, size_mb: float) -> list[str]:
    rope = config["rope_parameters"]
    ple = config["ple_layer_ids"]
    ple_row = (
        f"| PLE | on layer {', '.join(map(str, ple))} (one-indexed): hashed bi/tri-grams, "
        f"{config['ngram_size'] - 1} x {config['heads_per_ngram']} heads of about "
        f"{config['ngram_vocab_size_base']} rows, {config['ple_embed_dim']} dims in all |"
        if ple
        else "| PLE | off |"
    )
    return [
        f"| layers | {config['num_hidden_layers']} (+1 MTP), `{_layer_pattern(config)}` "
        "(L Gated DeltaNet, A gated attention with the QSA indexer, + PLE) |",
        f"| hidden / residual streams | {config['hidden_size']} / {config['hc_count']} gated "
        f"residual streams (mixer rank {config['hc_lowrank']}) |",
        f"| attention | {config['num_attention_heads']} query heads of {config['head_dim']}, "
        f"{config['num_key_value_heads']} KV heads, RoPE on "
        f"{rope['partial_rotary_factor']:g} of each head, sigmoid output gate |",
        f"| QSA indexer | {config['indexer_n_heads']} heads of {config['indexer_head_dim']}, "
        f"budget {config['indexer_budget']} tokens in blocks of "
        f"{config['indexer_compress_ratio']} |",
        f"| Gated DeltaNet | {config['linear_num_key_heads']} key / "
        f"{config['linear_num_value_heads']} value heads of {config['linear_key_head_dim']}, "
        f"conv {config['linear_conv_kernel_dim']} |",
        f"| MoE | {config['num_experts']} routed experts (softmax top-"
        f"{config['num_experts_per_tok']}, width {config['moe_intermediate_size']}) + a "
        f"sigmoid-gated shared expert (width {config['shared_expert_intermediate_size']}) |",
        ple_row,
        f"| vocabulary / context | {config['vocab_size']} byte-level BPE / "
        f"{config['max_position_embeddings']} |",
        f"| parameters | {params['total'] / 1e6:.2f} M ({params['trunk'] / 1e6:.2f} M trunk, "
        f"{params['mtp'] / 1e6:.2f} M MTP; embedding and head shared) |",
        f"| file | `model.safetensors`, {size_mb:.1f} MB, released Qwen4Exp text names "
        f"(`mtp.*` included; the n-gram table in {config['split_ngram_parts']} shards), BF16 "
        "(PLE hash tables I64) |",
    ]


def card_training_notes(summary: dict) -> list[str]:
    flow = (
        "The MTP reads the trunk streams detached (no MTP gradient into the trunk)."
        if summary["mtp_detach"]
        else "MTP gradients flow into the trunk."
    )
    return [
        f"* Loss = CE(next token) + {summary['mtp_weight']:g} x CE(MTP, token after next) + "
        f"{summary['router_aux_weight']:g} x the routers' load-balancing loss. {flow}",
        f"* The PLE n-gram table holds {summary['ple_table_params'] / 1e6:.2f} M of the trunk's "
        "parameters. The QSA indexers are not trained (their top-k selection is not "
        "differentiable; a distillation loss would train them): they keep their initial "
        "weights, and select among the blocks of a window once a query sees more than "
        "budget + block - 1 tokens.",
    ]
