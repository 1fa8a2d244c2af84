# SPDX-License-Identifier: Apache-2.0
"""The decoding variants a benchmark run compares (plain, NEXTN with some draft steps) and the
in-process engine of each, built from the shared flags of `scripts.bench.flags`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from scripts.bench.flags import capture_overrides
from scripts.bench.report import plain_share


@dataclass(frozen=True)
class Variant:
    """One decoding configuration a run measures: plain, or NEXTN with its shape."""

    label: str
    spec: dict | None  # Engine / launch_server speculative kwargs, None for plain decoding
    server_flags: tuple[str, ...] = ()  # more launch_server flags (e.g. the cache off)

    @property
    def is_plain(self) -> bool:
        return self.spec is None

    @property
    def num_steps(self) -> int:
        return 0 if self.spec is None else self.spec["speculative_num_steps"]


def build_variants(args: argparse.Namespace) -> list[Variant]:
    """Plain first (when `--compare` or no algorithm is given), then one NEXTN variant per
    requested step count and token map (with `--compare-fused-round`, each also with its
    greedy rounds run step by step). Bad speculative flags fail here, before any weight is
    read."""
    steps = args.speculative_num_steps
    steps = steps if isinstance(steps, list) else [steps]
    algorithm = args.speculative_algorithm or ("NEXTN" if args.compare else None)
    variants = []
    if args.compare or algorithm is None:
        if algorithm is None and any(s is not None for s in steps):
            raise ValueError(
                "--speculative-num-steps needs --speculative-algorithm NEXTN (or --compare)"
            )
        variants.append(Variant("plain", None))
    maps = args.speculative_token_map
    maps = maps if isinstance(maps, list) else [maps]
    if algorithm is not None:
        for s in steps:
            for token_map in maps:
                variant = _nextn_variant(args, algorithm, s, token_map)
                variants.append(variant)
                if getattr(args, "compare_fused_round", False):
                    variants.append(step_by_step(variant))
    return variants


def step_by_step(variant: Variant) -> Variant:
    """`variant` with its greedy NEXTN rounds run as separate captured steps."""
    label = f"{variant.label[:-1]}, step by step)"
    return Variant(label, {**variant.spec, "disable_fused_nextn_round": True}, variant.server_flags)


def _nextn_variant(args: argparse.Namespace, algorithm: str, steps, token_map) -> Variant:
    """`token_map` as the engine reads `--speculative-token-map` (unset or `auto`: the
    checkpoint's own table, if it names one; `none`: the whole vocabulary), resolved here
    so that the label says which and the engine is told exactly that."""
    from runtime.configs.engine_config import default_model_path
    from runtime.configs.speculative import SpeculativeConfig
    from runtime.configs.token_map import NONE

    cfg = SpeculativeConfig.resolve(
        algorithm,
        steps,
        args.speculative_eagle_topk,
        args.speculative_num_draft_tokens,
        args.speculative_disable_by_batch_size,
        token_map,
        getattr(args, "model_path", None) or default_model_path(),
    )
    spec = {
        "speculative_algorithm": cfg.algorithm,
        "speculative_num_steps": cfg.num_steps,
        "speculative_eagle_topk": cfg.eagle_topk,
        "speculative_num_draft_tokens": cfg.num_draft_tokens,
    }
    if args.speculative_disable_by_batch_size is not None:  # else the engine's default
        spec["speculative_disable_by_batch_size"] = args.speculative_disable_by_batch_size
    label = f"steps={cfg.num_steps}"
    spec["speculative_token_map"] = NONE if cfg.token_map is None else cfg.token_map
    if cfg.token_map is not None:
        label += f", hot={len(cfg.hot_token_ids)}"
    return Variant(f"{cfg.algorithm}({label})", spec)


def with_and_without_radix_cache(variants: list[Variant]) -> list[Variant]:
    """Each variant twice: with the prefix cache off (`--disable-radix-cache`), then on."""
    return [
        v
        for base in variants
        for v in (
            Variant(
                f"{base.label} cache-off", base.spec, (*base.server_flags, "--disable-radix-cache")
            ),
            Variant(f"{base.label} cache-on", base.spec, base.server_flags),
        )
    ]


def set_threads(threads: int) -> int:
    """Pin torch's intra-op threads so every variant (and the HF baseline) runs alike."""
    import torch

    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def resolve_model_path(model_path: str | None) -> str:
    """The checkpoint directory, or the engine's embedded default (FileNotFoundError if absent)."""
    from runtime.configs.engine_config import default_model_path

    return model_path or default_model_path()


def resolve_torch_dtype(model_path: str, dtype: str, device: str = "cpu"):
    """The torch dtype `Engine(dtype=..., device=...)` will run in, so the HF baseline can
    use the same."""
    from runtime.configs.model_config import ModelConfig

    return ModelConfig.from_path(model_path, dtype, device=device).dtype


def make_engine(args: argparse.Namespace, variant: Variant, **overrides):
    """An in-process `Engine` for `variant` with the shared flags (`overrides` win)."""
    from runtime import Engine

    kwargs = {
        "model_path": args.model_path,
        "dtype": args.dtype,
        "device": args.device,
        "quantization": getattr(args, "quantization", "auto"),
        "max_running_requests": args.max_running_requests,
        "random_seed": args.seed,
        **capture_overrides(args),
        **(variant.spec or {}),
    }
    kwargs.update(overrides)
    return Engine(**kwargs)


def spec_counters(engine) -> tuple[int, int, int]:
    """(emitted tokens, verify rounds, tokens decoded without speculation) so far; deltas
    give a run's own accept length and plainly decoded share."""
    if not getattr(engine, "spec_config", None):
        return 0, 0, 0
    stats = engine.worker.stats
    return stats.emitted_tokens, stats.verify_rounds, stats.plain_decode_tokens


def plain_share_between(before: tuple, after: tuple) -> float | None:
    """The share of decoded tokens between two `spec_counters` readings that came from steps
    without speculation (None without decoded tokens)."""
    return plain_share(after[2] - before[2], after[0] - before[0])


def accept_length_between(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """Tokens per verify round between two `spec_counters` readings (None without rounds)."""
    rounds = after[1] - before[1]
    return (after[0] - before[0]) / rounds if rounds else None


def greedy_params(output_len: int, ignore_eos: bool = True) -> dict:
    """Greedy sampling of exactly `output_len` tokens (unless EOS may stop it)."""
    return {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": ignore_eos}
