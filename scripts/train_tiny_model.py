# SPDX-License-Identifier: Apache-2.0
"""Train the embedded default model: a tiny DeepSeek-V4 with one MTP (NextN) layer, on CPU.

The corpus is the Python standard library of the running interpreter (offline everywhere),
split by file into train and held-out parts. The script trains a byte-level BPE tokenizer,
then the trunk (transformers' DeepSeek-V4 modules, training mode, no cache) together with
one MTP layer whose math is exactly the runtime's draft (runtime/models/deepseek_v4_mtp.py):

    e = enorm(embed(t_{i+1}))  (zero at position 0)
    x = h_proj(hnorm(h_i)) + e_proj(e)       h_i: trunk streams before hc_head, [hc, H]
    x = V4 decoder block (window-only attention, learned routing)
    logits_i = head(norm(hc_head(x)))        predicts t_{i+2}

Loss = CE(trunk, t_{i+1}) + mtp_weight * CE(MTP, t_{i+2}). The output directory is a
released-naming checkpoint (bf16 safetensors, `mtp.0.*` included), config.json, the
tokenizer and a README model card with held-out losses and the runtime's measured NEXTN
acceptance and speed.

    python scripts/train_tiny_model.py --max-minutes 60           # train, export, evaluate
    python scripts/train_tiny_model.py --resume --max-minutes 90  # continue from --work-dir
    python scripts/train_tiny_model.py --evaluate-only runtime/assets/deepseek_v4_tiny
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import sys
import sysconfig
import tempfile
import time
import types
from dataclasses import dataclass
from pathlib import Path

# Threads that wait at OpenMP barriers must sleep, not spin: with 2 threads on 2 shared
# cores, a spinning thread starves its partner whenever another process runs, and steps
# become 5-50x slower. Set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # scripts/ is not a package; make `runtime` importable
    sys.path.insert(0, str(REPO_ROOT))

from runtime.models.deepseek_v4 import hf_to_released_name  # noqa: E402

DEFAULT_OUTPUT = REPO_ROOT / "runtime" / "assets" / "deepseek_v4_tiny"
DEFAULT_WORK_DIR = Path(tempfile.gettempdir()) / "train_tiny_model"
STATE_FILE = "train_state.pt"

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_MARKERS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_MARKERS.values()]  # ids 0..5, in this order
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant') }}{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


# ---------------------------------------------------------------------------------------
# Corpus and tokenizer
# ---------------------------------------------------------------------------------------


def stdlib_sources(limit_files: int | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of the interpreter's standard library `*.py`, sorted by path.

    Installed packages (site-/dist-packages) are left out: they differ between machines.
    Files that are not UTF-8 (a few deliberate test fixtures) are skipped. `limit_files`
    keeps an evenly spaced subset, so a small slice still has held-out files.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        (p.relative_to(root).as_posix(), p)
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    )
    if limit_files:
        paths = paths[:: max(1, len(paths) // limit_files)][:limit_files]
    sources = []
    for rel, path in paths:
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            sources.append((rel, text))
    return sources


def split_by_file(sources: list, holdout_every: int) -> tuple[list, list]:
    """Every `holdout_every`-th file (0, n, 2n, ...) is held out; the rest trains."""
    held = [s for i, s in enumerate(sources) if i % holdout_every == 0]
    train = [s for i, s in enumerate(sources) if i % holdout_every != 0]
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` with the special tokens at ids 0..5.

    Encoding a single text prepends <|bos|> (as every training document starts with it),
    so prompts served by the runtime look like the start of a training file.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tokenizer


def save_tokenizer(tokenizer, out_dir: Path, max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json that `AutoTokenizer.from_pretrained` loads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": list(ROLE_MARKERS.values()),
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": list(ROLE_MARKERS.values()),
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_documents(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents as one id stream, each framed `<|bos|> text <|eos|>`."""
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids += [bos, *enc.ids, eos]
    return torch.tensor(ids, dtype=torch.int32)


# ---------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------


def layer_schedule(num_layers: int) -> list[str]:
    """Window-only first layers, then CSA / HCA alternating (DeepSeek-V4-Flash's pattern)."""
    head = min(num_layers, 2 if num_layers >= 6 else 1)
    kinds = ["compressed_sparse_attention", "heavily_compressed_attention"]
    return ["sliding_attention"] * head + [kinds[i % 2] for i in range(num_layers - head)]


def model_config(args: argparse.Namespace, vocab_size: int) -> dict:
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
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
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
        """`streams [B, S, hc, H]`, `next_embeds [B, S, H]` (embedding of t_{i+1}) ->
        normed hidden `[B, S, H]` for the shared head."""
        next_embeds = next_embeds.masked_fill((positions == 0).view(1, -1, 1), 0)
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(next_embeds)).unsqueeze(2)
        x = self.block(
            x, position_embeddings=rope, position_ids=positions.unsqueeze(0), attention_mask=mask
        )
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
        rope = {
            kind: model.rotary_emb(streams, positions.unsqueeze(0), layer_type=kind)
            for kind in ("main", "compress")
        }
        mask = sliding_window_mask(seq, self.config["sliding_window"], tokens.device)
        hidden = self.mtp(streams, model.embed_tokens(next_ids), rope, positions, mask)
        return trunk_logits, self.trunk.lm_head(hidden)


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

    @torch.no_grad()
    def update(self) -> None:
        for router in self.routers:
            load = self.loads[id(router)]
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            load.zero_()


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


def count_parameters(model: TinyV4) -> dict[str, int]:
    trunk = sum(p.numel() for p in model.trunk.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    return {"trunk": trunk, "mtp": mtp, "total": trunk + mtp}


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------


@dataclass
class TrainState:
    step: int = 0
    elapsed: float = 0.0  # training seconds so far, across resumes
    tokens: int = 0


def sample_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `seq + 2` tokens (inputs, next and after-next targets)."""
    starts = torch.randint(0, len(stream) - seq - 2, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq + 2] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor, count: int, seq: int) -> torch.Tensor:
    """`count` evenly spaced windows of the held-out stream (the same every time)."""
    count = max(1, min(count, (len(stream) - 1) // (seq + 2)))
    starts = torch.linspace(0, len(stream) - seq - 2, count).long()
    return torch.stack([stream[s : s + seq + 2] for s in starts.tolist()])


def losses(model: TinyV4, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Cross-entropies of the trunk (t_{i+1}) and the MTP (t_{i+2}), plus top-1 agreement
    of the MTP with the trunk's next prediction (what greedy NEXTN accepts as draft 1)."""
    seq = tokens.shape[1] - 2
    trunk_logits, mtp_logits = model(tokens)
    targets = tokens.long()
    trunk = F.cross_entropy(trunk_logits.flatten(0, 1).float(), targets[:, 1 : seq + 1].flatten())
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), targets[:, 2:].flatten())
    with torch.no_grad():
        trunk_pred, mtp_pred = trunk_logits.argmax(-1), mtp_logits.argmax(-1)
        agree = (mtp_pred[:, :-1] == trunk_pred[:, 1:]).float().mean()
        trunk_acc = (trunk_pred == targets[:, 1 : seq + 1]).float().mean()
        mtp_acc = (mtp_pred == targets[:, 2:]).float().mean()
    return {
        "trunk": trunk,
        "mtp": mtp,
        "trunk_acc": trunk_acc,
        "mtp_acc": mtp_acc,
        "mtp_agreement": agree,
    }


@torch.no_grad()
def evaluate_heldout(model: TinyV4, windows: torch.Tensor, batch: int, autocast: bool) -> dict:
    """Mean held-out losses / accuracies over fixed windows."""
    model.eval()
    totals: dict[str, float] = {}
    for i in range(0, len(windows), batch):
        chunk = windows[i : i + batch]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            result = losses(model, chunk)
        for k, v in result.items():
            totals[k] = totals.get(k, 0.0) + v.item() * len(chunk)
    model.train()
    return {k: v / len(windows) for k, v in totals.items()}


def make_optimizer(model: TinyV4, args) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms, biases, mHC mixers, sinks)."""
    decay, rest = [], []
    for name, param in model.named_parameters():
        plain_matrix = param.ndim >= 2 and "hc" not in name
        (decay if plain_matrix else rest).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def learning_rate(args, state: TrainState) -> float:
    """Linear warm-up, then cosine to `min_lr_ratio * lr`; progress is whichever of the step
    and time budgets is further along, so the schedule ends when training does."""
    if state.step < args.warmup_steps:
        return args.lr * (state.step + 1) / args.warmup_steps
    progress = 0.0
    if args.max_steps:
        progress = max(progress, state.step / args.max_steps)
    if args.max_minutes:
        progress = max(progress, state.elapsed / (60 * args.max_minutes))
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def budget_left(args, state: TrainState) -> bool:
    if args.max_steps and state.step >= args.max_steps:
        return False
    return not (args.max_minutes and state.elapsed >= 60 * args.max_minutes)


def save_state(path: Path, model, optimizer, state: TrainState, gen, config) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "state": vars(state),
            "data_rng": gen.get_state(),
            "config": config,
        },
        tmp,
    )
    os.replace(tmp, path)  # never leave a half-written state behind


def train(args, model: TinyV4, train_stream, held_windows, work_dir: Path) -> TrainState:
    """The training loop: stops at --max-steps / --max-minutes, saving its state as it goes."""
    from tqdm import tqdm

    optimizer = make_optimizer(model, args)
    balancer = ExpertBalancer(model, args.bias_update_rate)
    gen = torch.Generator().manual_seed(args.seed + 2)
    state, state_path = TrainState(), work_dir / STATE_FILE
    if args.resume and state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        gen.set_state(saved["data_rng"])
        state = TrainState(**saved["state"])
        print(f"resumed from {state_path} at step {state.step}", flush=True)
    model.train()
    interactive = sys.stderr.isatty()
    bar = tqdm(
        total=args.max_steps or None,
        initial=state.step,
        dynamic_ncols=interactive,
        mininterval=2 if interactive else 30,
        desc="train",
    )
    last_save = last_eval = state.elapsed
    while budget_left(args, state):
        started = time.perf_counter()
        lr = learning_rate(args, state)
        for group in optimizer.param_groups:
            group["lr"] = lr
        tokens = sample_batch(train_stream, args.batch_size, args.seq_len, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            result = losses(model, tokens)
        loss = result["trunk"] + args.mtp_weight * result["mtp"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        balancer.update()
        state.step += 1
        state.tokens += tokens.numel() - 2 * len(tokens)
        state.elapsed += time.perf_counter() - started
        bar.update(1)
        bar.set_postfix(
            loss=f"{result['trunk'].item():.3f}",
            mtp=f"{result['mtp'].item():.3f}",
            agree=f"{result['mtp_agreement'].item():.2f}",
            lr=f"{lr:.1e}",
            min=f"{state.elapsed / 60:.1f}",
            refresh=False,
        )
        if state.elapsed - last_eval >= 60 * args.eval_every_minutes:
            last_eval = state.elapsed
            held = evaluate_heldout(model, held_windows, args.batch_size, args.precision == "bf16")
            bar.write(f"step {state.step} ({state.elapsed / 60:.1f} min): held-out " + _fmt(held))
        if state.elapsed - last_save >= 60 * args.save_every_minutes:
            last_save = state.elapsed
            save_state(state_path, model, optimizer, state, gen, model.config)
    bar.close()
    save_state(state_path, model, optimizer, state, gen, model.config)
    return state


def _fmt(metrics: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


# ---------------------------------------------------------------------------------------
# Corpus preparation, export
# ---------------------------------------------------------------------------------------


@dataclass
class Corpus:
    tokenizer: object  # tokenizers.Tokenizer
    train_stream: torch.Tensor
    held_stream: torch.Tensor
    held_sources: list
    info: dict


def prepare_corpus(args, work_dir: Path) -> Corpus:
    """Read and split the stdlib, train (or, when resuming, reload) the tokenizer, encode."""
    from tokenizers import Tokenizer

    sources = stdlib_sources(args.corpus_limit_files)
    train_sources, held_sources = split_by_file(sources, args.holdout_every)
    tok_file = work_dir / "tokenizer.json"
    if args.resume and tok_file.exists():
        tokenizer = Tokenizer.from_file(str(tok_file))
    else:
        tokenizer = train_tokenizer([text for _, text in train_sources], args.vocab_size)
        tokenizer.save(str(tok_file))
    train_stream = encode_documents(tokenizer, [text for _, text in train_sources])
    held_stream = encode_documents(tokenizer, [text for _, text in held_sources])
    info = {
        "python": sys.version.split()[0],
        "stdlib": sysconfig.get_paths()["stdlib"],
        "files_train": len(train_sources),
        "files_heldout": len(held_sources),
        "bytes_train": sum(len(t.encode()) for _, t in train_sources),
        "bytes_heldout": sum(len(t.encode()) for _, t in held_sources),
        "tokens_train": len(train_stream),
        "tokens_heldout": len(held_stream),
        "holdout_every": args.holdout_every,
        "limit_files": args.corpus_limit_files,
        "vocab_size": tokenizer.get_vocab_size(),
    }
    return Corpus(tokenizer, train_stream, held_stream, held_sources, info)


def export_checkpoint(model: TinyV4, tokenizer, out_dir: Path) -> float:
    """Write config.json, model.safetensors (released naming, bf16) and the tokenizer into
    `out_dir`; returns the weights file size in MB."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(model.config, indent=2) + "\n")
    weights = out_dir / "model.safetensors"
    save_file(released_state_dict(model), str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors writes 0600; the file ships with the package
    save_tokenizer(tokenizer, out_dir, model.config["max_position_embeddings"])
    return weights.stat().st_size / 1e6


def load_checkpoint(path: Path) -> TinyV4:
    """The training-form model (trunk + MTP, fp32) of a checkpoint this script wrote."""
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())
    model = TinyV4(config, seed=0)
    load_released_state_(model, load_file(str(path / "model.safetensors")))
    return model


# ---------------------------------------------------------------------------------------
# Evaluation with the runtime (and transformers as an oracle)
# ---------------------------------------------------------------------------------------


def eval_prompts(held_sources: list, count: int, min_chars=200, max_chars=320) -> list[str]:
    """The opening of `count` evenly spaced held-out files, cut at a line end."""
    usable = [text for _, text in held_sources if len(text) > max_chars]
    picked = usable[:: max(1, len(usable) // count)][:count]
    prompts = []
    for text in picked:
        cut = text.rfind("\n", min_chars, max_chars)
        prompts.append(text[: cut + 1] if cut >= 0 else text[:max_chars])
    return prompts


def _warm_up(engine, prompt: str, params: dict) -> None:
    engine.generate(prompt, {**params, "max_new_tokens": 8})


def _timed_generate(engine, prompts: list[str], params: dict) -> tuple[list[dict], float]:
    """Batch-1 generation of each prompt in turn; (results, seconds)."""
    results, seconds = [], 0.0
    for prompt in prompts:
        started = time.perf_counter()
        results.append(engine.generate(prompt, params))
        seconds += time.perf_counter() - started
    return results, seconds


def _tokens_per_s(results: list[dict], seconds: float) -> float:
    return sum(len(r["output_ids"]) for r in results) / seconds


def pick_dtype(path: Path, prompts: list[str], params: dict) -> tuple[str, dict[str, float]]:
    """The faster of float32 and bfloat16 for plain batch-1 decoding of `prompts`."""
    from runtime import Engine

    speeds = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(model_path=str(path), dtype=dtype)
        _warm_up(engine, prompts[0], params)
        speeds[dtype] = _tokens_per_s(*_timed_generate(engine, prompts, params))
    return max(speeds, key=speeds.get), speeds


def runtime_report(path: Path, prompts: list[str], dtype: str, steps: int, new_tokens: int) -> dict:
    """Serve the checkpoint with the runtime, plain and with NEXTN: speed and acceptance.
    `dtype="auto"` first measures which of float32 / bfloat16 decodes faster."""
    from runtime import Engine

    params = {"temperature": 0, "max_new_tokens": new_tokens}
    dtype_speeds = None
    if dtype == "auto":
        dtype, dtype_speeds = pick_dtype(path, prompts[:4], params)
    plain = Engine(model_path=str(path), dtype=dtype)
    _warm_up(plain, prompts[0], params)
    plain_results, plain_seconds = _timed_generate(plain, prompts, params)
    del plain
    nextn = Engine(
        model_path=str(path),
        dtype=dtype,
        speculative_algorithm="NEXTN",
        speculative_num_steps=steps,
    )
    _warm_up(nextn, prompts[0], params)
    stats = nextn.worker.stats  # engine-wide counters: take the difference over the prompts
    rounds0, emitted0 = stats.verify_rounds, stats.emitted_tokens
    accepted0 = list(stats.accepted_at)
    nextn_results, nextn_seconds = _timed_generate(nextn, prompts, params)
    rounds = stats.verify_rounds - rounds0
    histogram = [0] * (steps + 1)
    for result in nextn_results:
        for m, n in enumerate(result["meta_info"]["spec_accept_histogram"]):
            histogram[m] += n
    plain_speed = _tokens_per_s(plain_results, plain_seconds)
    nextn_speed = _tokens_per_s(nextn_results, nextn_seconds)
    return {
        "dtype": dtype,
        "dtype_plain_tokens_per_s": dtype_speeds,
        "threads": torch.get_num_threads(),
        "num_prompts": len(prompts),
        "max_new_tokens": new_tokens,
        "speculative_num_steps": steps,
        "accept_length": (stats.emitted_tokens - emitted0) / rounds,
        "accept_rate_per_position": [
            (a - a0) / rounds for a, a0 in zip(stats.accepted_at, accepted0, strict=True)
        ],
        "accept_histogram": histogram,
        "plain_tokens_per_s": plain_speed,
        "nextn_tokens_per_s": nextn_speed,
        "speedup": nextn_speed / plain_speed,
        "nextn_equals_plain": sum(
            p["output_ids"] == s["output_ids"]
            for p, s in zip(plain_results, nextn_results, strict=True)
        ),
        "sample": {"prompt": prompts[0], "completion": nextn_results[0]["text"]},
    }


def transformers_parity(path: Path, prompts: list[str], new_tokens: int = 32) -> dict:
    """transformers loads the directory (ignoring `mtp.*`), and its greedy `generate`
    equals the runtime's greedy output in fp32."""
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM

    from runtime import Engine

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    engine = Engine(model_path=str(path), dtype="float32")
    equal = []
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        ours = engine.generate(
            input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": new_tokens}
        )
        equal.append(out[0, len(ids) :].tolist() == ours["output_ids"])
    return {"prompts": len(prompts), "new_tokens": new_tokens, "equal": sum(equal)}


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


def _dtype_note(report: dict) -> str:
    speeds = report.get("dtype_plain_tokens_per_s")
    if not speeds:
        return ""
    shown = ", ".join(f"{dtype} {speed:.1f}" for dtype, speed in speeds.items())
    return f" ({report['dtype']} is the faster here; plain tokens/s on 4 prompts: {shown})"


def model_card(config: dict, summary: dict, report: dict | None, parity: dict | None) -> str:
    """README.md of the checkpoint directory, from the training summary and measurements."""
    params, corpus, held = summary["params"], summary["corpus"], summary["heldout"]
    rates = config["compress_rates"]
    lines = [
        "# deepseek_v4_tiny: the embedded default model of nextn-runtime",
        "",
        "A tiny DeepSeek-V4 with one MTP (NextN) layer, trained from scratch on CPU by",
        "`scripts/train_tiny_model.py` on the Python standard library. It exists so that the",
        "runtime serves something by default and NEXTN speculative decoding has drafts worth",
        "accepting. It continues Python source with Python-looking text, often repetitive",
        "(an hour of CPU training); it is not an assistant (the chat template only frames",
        "messages, the model never saw chat data) and knows nothing but the standard library.",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
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
        f"| file | `model.safetensors`, {summary['size_mb']:.1f} MB, released DeepSeek-V4 names "
        "(`mtp.0.*` included), BF16 (mHC mixers, sinks, biases F32) |",
        "",
        "## Training",
        "",
        f"* Corpus: the standard library `*.py` of Python {corpus['python']} (site-packages "
        f"excluded), sorted by path, every {corpus['holdout_every']}th file held out: "
        f"{corpus['files_train']} train files ({corpus['bytes_train'] / 1e6:.1f} MB, "
        f"{corpus['tokens_train'] / 1e6:.2f} M tokens), {corpus['files_heldout']} held-out files "
        f"({corpus['tokens_heldout'] / 1e6:.2f} M tokens). Each file is framed "
        "`<|bos|> ... <|eos|>`.",
        f"* Tokenizer: byte-level BPE ({config['vocab_size']} entries) trained on the train "
        "split with `tokenizers`; special tokens `<|bos|> <|eos|> <|pad|> <|system|> <|user|> "
        "<|assistant|>`; encoding a text prepends `<|bos|>`.",
        f"* {summary['steps']} steps in {summary['train_minutes']:.1f} minutes on "
        f"{summary['threads']} CPU threads ({summary['train_tokens'] / 1e6:.2f} M tokens): "
        f"batch {summary['batch_size']} x {summary['seq_len']} tokens, AdamW (0.9, 0.95), "
        f"peak lr {summary['lr']:g}, {summary['warmup_steps']} warm-up steps then cosine to "
        f"{summary['min_lr_ratio']:g}x, weight decay {summary['weight_decay']:g}, "
        f"{summary['precision']} autocast, seed {summary['seed']}.",
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
        "",
        "## Held-out results",
        "",
        f"Over {summary['heldout_windows']} windows of {summary['seq_len']} tokens of the held-out "
        "files (training-form model):",
        "",
        "| | loss | top-1 accuracy |",
        "|---|---|---|",
        f"| trunk (next token) | {held['trunk']:.3f} (ppl {math.exp(held['trunk']):.1f}) | "
        f"{held['trunk_acc']:.3f} |",
        f"| MTP (token after next) | {held['mtp']:.3f} | {held['mtp_acc']:.3f} |",
        "",
        f"MTP argmax = trunk's next argmax (the first draft token greedy NEXTN accepts): "
        f"{held['mtp_agreement']:.3f}.",
    ]
    if report is not None:
        per_pos = ", ".join(f"{r:.3f}" for r in report["accept_rate_per_position"])
        lines += [
            "",
            "## Served by the runtime",
            "",
            f'`Engine(model_path=DIR, dtype="{report["dtype"]}")`, greedy, '
            f"{report['max_new_tokens']} new tokens for each of {report['num_prompts']} prompts "
            "(the first lines, up to 320 characters, of held-out files), one at a time (batch 1), "
            f"{report['threads']} torch threads with `OMP_WAIT_POLICY=PASSIVE`"
            + _dtype_note(report)
            + ":",
            "",
            "| | tokens/s |",
            "|---|---|",
            f"| plain decoding | {report['plain_tokens_per_s']:.1f} |",
            f"| NEXTN, {report['speculative_num_steps']} draft steps | "
            f"{report['nextn_tokens_per_s']:.1f} ({report['speedup']:.2f}x) |",
            "",
            f"* Accept length (tokens per verify round): **{report['accept_length']:.2f}**.",
            f"* Share of rounds that accepted draft 1..{report['speculative_num_steps']}: "
            f"{per_pos}.",
            f"* Histogram of accepted drafts per round (index m = rounds that accepted m): "
            f"{report['accept_histogram']}.",
            f"* NEXTN output identical to plain greedy output for "
            f"{report['nextn_equals_plain']} of {report['num_prompts']} prompts.",
        ]
    if parity is not None:
        lines += [
            f"* transformers `DeepseekV4ForCausalLM.from_pretrained` loads this directory "
            f"(ignoring `mtp.*`); its greedy `generate` equals the runtime's (fp32) on "
            f"{parity['equal']} of {parity['prompts']} prompts "
            f"({parity['new_tokens']} tokens)."
        ]
    lines += [
        "",
        "## Reproduce",
        "",
        "```bash",
        f"python {summary['command']}",
        f"python scripts/train_tiny_model.py --evaluate-only {summary['output_dir']}",
        "```",
        "",
        "Training is deterministic for a given seed, Python standard library and step budget "
        "(`--max-steps N --max-minutes 0`). This checkpoint had a time budget, so its cosine "
        "schedule followed the clock: a rerun trains as many steps as fit in that time on "
        "its machine. Figures above were measured on a shared 2-core CPU (other jobs ran "
        "during training) and vary with its load.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------


def evaluate_checkpoint(path: Path, args) -> dict:
    """Held-out losses of the saved weights, the runtime's NEXTN acceptance and speed, and
    transformers parity; writes evaluation.json and README.md into `path`."""
    from tokenizers import Tokenizer

    summary = json.loads((path / "training.json").read_text())
    config = json.loads((path / "config.json").read_text())
    corpus = summary["corpus"]
    _, held_sources = split_by_file(stdlib_sources(corpus["limit_files"]), corpus["holdout_every"])
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    windows = eval_windows(
        encode_documents(tokenizer, [t for _, t in held_sources]),
        args.eval_windows,
        summary["seq_len"],
    )
    model = load_checkpoint(path)
    summary["heldout"] = evaluate_heldout(model, windows, summary["batch_size"], autocast=False)
    summary["heldout_windows"] = len(windows)
    del model
    print("held-out: " + _fmt(summary["heldout"]), flush=True)
    report = parity = None
    if not args.skip_runtime_eval:
        prompts = eval_prompts(held_sources, args.eval_prompts)
        report = runtime_report(
            path, prompts, args.eval_dtype, args.spec_steps, args.eval_new_tokens
        )
        parity = transformers_parity(path, prompts[:2])
        print(json.dumps({**report, "transformers_parity": parity}, indent=2), flush=True)
    (path / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    (path / "evaluation.json").write_text(
        json.dumps(
            {"heldout": summary["heldout"], "runtime": report, "transformers_parity": parity},
            indent=2,
        )
        + "\n"
    )
    (path / "README.md").write_text(model_card(config, summary, report, parity))
    return {"heldout": summary["heldout"], "runtime": report, "transformers_parity": parity}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    run = p.add_argument_group("run")
    run.add_argument("--output-dir", default=str(DEFAULT_OUTPUT))
    run.add_argument(
        "--work-dir",
        default=str(DEFAULT_WORK_DIR),
        help="training state and tokenizer, for --resume",
    )
    run.add_argument("--resume", action="store_true", help="continue from --work-dir's state")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--max-minutes", type=float, default=60.0, help="training-loop time budget (0: none)"
    )
    run.add_argument("--max-steps", type=int, default=0, help="step budget (0: none)")
    run.add_argument("--threads", type=int, default=2)
    run.add_argument("--save-every-minutes", type=float, default=10.0)
    run.add_argument("--eval-every-minutes", type=float, default=10.0)
    data = p.add_argument_group("corpus")
    data.add_argument(
        "--corpus-limit-files",
        type=int,
        default=0,
        help="train on an evenly spaced slice of this many files (0: all)",
    )
    data.add_argument("--holdout-every", type=int, default=20)
    data.add_argument("--vocab-size", type=int, default=4096)
    shape = p.add_argument_group("shape")
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
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--seq-len", type=int, default=256)
    opt.add_argument("--batch-size", type=int, default=8)
    opt.add_argument("--lr", type=float, default=2e-3)
    opt.add_argument("--min-lr-ratio", type=float, default=0.1)
    opt.add_argument("--warmup-steps", type=int, default=100)
    opt.add_argument("--weight-decay", type=float, default=0.1)
    opt.add_argument("--grad-clip", type=float, default=1.0)
    opt.add_argument("--mtp-weight", type=float, default=0.5)
    opt.add_argument(
        "--mtp-detach",
        action="store_true",
        help="no MTP gradient into the trunk (the MTP reads detached streams)",
    )
    opt.add_argument(
        "--bias-update-rate",
        type=float,
        default=1e-3,
        help="router balancing bias step per training step",
    )
    opt.add_argument(
        "--precision",
        choices=("bf16", "fp32"),
        default="bf16",
        help="bf16 autocast measured ~15%% faster than fp32 on a 2-core AVX512 CPU",
    )
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--evaluate-only", metavar="DIR", help="only evaluate a checkpoint directory")
    ev.add_argument(
        "--skip-runtime-eval",
        action="store_true",
        help="held-out losses only (no runtime speed / acceptance, no parity check)",
    )
    ev.add_argument("--eval-windows", type=int, default=64)
    ev.add_argument("--eval-prompts", type=int, default=20)
    ev.add_argument("--eval-new-tokens", type=int, default=64)
    ev.add_argument(
        "--eval-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="runtime dtype for the speed figures; auto: the faster one",
    )
    ev.add_argument("--spec-steps", type=int, default=3)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def _training_summary(args, state: TrainState, model: TinyV4, corpus: Corpus) -> dict:
    output = Path(args.output_dir).resolve()
    shown = output.relative_to(REPO_ROOT) if output.is_relative_to(REPO_ROOT) else output
    return {
        "command": " ".join(["scripts/train_tiny_model.py", *args.argv]),
        "output_dir": str(shown),
        "seed": args.seed,
        "steps": state.step,
        "train_minutes": state.elapsed / 60,
        "train_tokens": state.tokens,
        "threads": args.threads,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "min_lr_ratio": args.min_lr_ratio,
        "weight_decay": args.weight_decay,
        "precision": args.precision,
        "mtp_weight": args.mtp_weight,
        "mtp_detach": args.mtp_detach,
        "params": count_parameters(model),
        "corpus": corpus.info,
    }


def main(argv=None) -> dict:
    """Train, export and evaluate (or only evaluate); returns the evaluation figures."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.evaluate_only:
        return evaluate_checkpoint(Path(args.evaluate_only), args)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    corpus = prepare_corpus(args, work_dir)
    print("corpus: " + json.dumps(corpus.info), flush=True)
    config = model_config(args, corpus.tokenizer.get_vocab_size())
    state_path = work_dir / STATE_FILE
    if args.resume and state_path.exists():
        config = torch.load(state_path, weights_only=False)["config"]  # the shape trained so far
    model = TinyV4(config, args.seed)
    model.detach_streams = args.mtp_detach
    print("parameters: " + json.dumps(count_parameters(model)), flush=True)
    held_windows = eval_windows(corpus.held_stream, max(1, args.eval_windows // 4), args.seq_len)
    state = train(args, model, corpus.train_stream, held_windows, work_dir)
    output = Path(args.output_dir)
    summary = _training_summary(args, state, model, corpus)
    summary["size_mb"] = export_checkpoint(model, corpus.tokenizer, output)
    (output / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"wrote {output} ({summary['size_mb']:.1f} MB) after {state.step} steps, "
        f"{state.elapsed / 60:.1f} min",
        flush=True,
    )
    return evaluate_checkpoint(output, args)


if __name__ == "__main__":
    main()
