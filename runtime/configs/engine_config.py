# SPDX-License-Identifier: Apache-2.0
"""`EngineConfig`: every engine setting, its default and its check, written once.

`Engine(config, **overrides)`, `ServerArgs` (which adds the HTTP-only flags) and the
benchmark scripts all read these fields. Names and meanings follow SGLang's
`server_args.py`; like SGLang's `ServerArgs.add_cli_args` / `from_cli_args`, each field
carries its own help text so the command-line flags are generated from the dataclass:

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser, names=("model_path", "dtype"))
    config = EngineConfig.from_cli_args(parser.parse_args())
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from runtime.configs.capture import CAPTURE_COMPILE_MODES, DISABLE_ENV, CaptureConfig
from runtime.configs.model_config import QUANTIZATION_CHOICES, SUPPORTED_DTYPES, resolve_dtype
from runtime.configs.parallel import ParallelLayout, parse_address
from runtime.configs.speculative import (
    DEFAULT_EAGLE_TOPK,
    DEFAULT_NUM_STEPS,
    SpeculativeConfig,
)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "deepseek_v4_tiny"
# SGLang's defaults when memory does not decide: 64 request slots, 48 with EAGLE/NEXTN.
DEFAULT_MAX_RUNNING_REQUESTS = 64
SPECULATIVE_MAX_RUNNING_REQUESTS = 48
# The OpenAI API's upper bound on `n` (choices per request).
DEFAULT_MAX_N = 128
# vLLM's default `max_logprobs`; the OpenAI chat API's own bound on `top_logprobs`.
DEFAULT_MAX_TOP_LOGPROBS = 20
# Logprob entries one response may carry (see `engine/request_limits.py`): a scored
# 24k-token context with 20 alternatives per token, about 20 MB of JSON.
DEFAULT_MAX_LOGPROB_ENTRIES = 2**19


def default_model_path() -> str:
    """The embedded tiny DeepSeek-V4 + MTP checkpoint shipped in the package."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"no --model-path given and the embedded default model is missing at "
            f"{DEFAULT_MODEL_DIR}; pass --model-path or reinstall the package"
        )
    return str(DEFAULT_MODEL_DIR)


def _known_dtype(dtype) -> bool:
    """`auto`, a name or alias `resolve_dtype` knows (e.g. bf16), or a supported torch dtype."""
    try:
        resolve_dtype(dtype)
    except ValueError:
        return False
    return True


def _help_text(f: dataclasses.Field) -> str | None:
    """A field's help for `--help`, ending in its default unless the text already says what
    the default is (a default that depends on other flags) or there is none to show."""
    text = f.metadata.get("help")
    if text is None:
        return None
    text = text.replace("%", "%%")  # argparse formats help with %-style placeholders
    if "default" in text.lower() or f.default is None or f.default is False:
        return text
    return text + " (default: %(default)s)"


def setting(default, help: str, *aliases: str):
    """A dataclass field that also describes its command-line flag."""
    return field(default=default, metadata={"help": help, "aliases": aliases})


@dataclass
class EngineConfig:
    model_path: str | None = setting(
        None,
        "checkpoint directory (default: the embedded tiny DeepSeek-V4 + MTP model)",
        "--model",
    )
    tokenizer_path: str | None = setting(None, "tokenizer directory (default: the model path)")
    dtype: str = setting("auto", f"one of {', '.join(SUPPORTED_DTYPES)}")
    device: str = setting("cpu", "torch device")
    quantization: str = setting(
        "auto",
        "quantized checkpoint weights kept in their format in memory (SGLang's flag): 'auto' "
        "the formats config.json's quantization_config declares (FP8 block, MXFP4 experts), "
        "'fp8' or 'mxfp4' only that one, 'none' dequantize every weight on load to --dtype",
    )
    page_size: int = setting(1, "tokens per KV cache page")
    max_total_tokens: int = setting(65536, "KV cache capacity in tokens")
    max_running_requests: int | None = setting(
        None,
        f"request slots (default {DEFAULT_MAX_RUNNING_REQUESTS}, "
        f"{SPECULATIVE_MAX_RUNNING_REQUESTS} with speculative decoding)",
    )
    # SGLang's smallest automatic size; on a CPU, smaller chunks pay their per-step work
    # (metadata, window gathers, many small operators) more often
    chunked_prefill_size: int | None = setting(2048, "prefill tokens per step (-1: no chunking)")
    context_length: int | None = setting(
        None, "prompt + output tokens per request (default: the model's max positions)"
    )
    random_seed: int | None = setting(None, "seed of the engine's sampling generator")
    disable_radix_cache: bool = setting(
        False, "turn off prefix caching: every request prefills its whole prompt"
    )
    radix_snapshot_interval: int = setting(
        256,
        "prefill chunks end at multiples of this many tokens so the prefix cache keeps the "
        "per-request state there (0: only at finish, retraction and shared prefixes)",
    )
    radix_snapshot_slots: int | None = setting(
        None,
        "per-request state snapshots the prefix cache keeps (default: 2 x --max-running-requests)",
    )
    skip_tokenizer_init: bool = setting(False, "load no tokenizer: clients send input_ids")
    speculative_algorithm: str | None = setting(None, "NEXTN (aliases MTP, EAGLE)")
    speculative_num_steps: int | None = setting(
        None, f"draft steps per round (default {DEFAULT_NUM_STEPS})"
    )
    speculative_eagle_topk: int | None = setting(None, f"{DEFAULT_EAGLE_TOPK} (chain drafting)")
    speculative_num_draft_tokens: int | None = setting(None, "verify width (steps + 1)")
    speculative_disable_by_batch_size: str | int | None = setting(
        "auto",
        "decode steps of at least this many requests run without speculation (verify rounds "
        "cost more than they save in large batches; the draft catches up when the batch "
        "shrinks); 'auto': each captured batch bucket speculates while its measured rounds "
        "yield tokens faster than plain decode steps (the default); 'none': always speculate",
    )
    speculative_token_map: str | None = setting(
        "auto",
        "file of the token ids the draft's LM head scores (FR-Spec hot vocabulary: a "
        "torch.save'd list or tensor, or a JSON list; scripts/make_token_map.py writes one); "
        "a cheaper draft step, output unchanged. 'auto' (the default): the table the "
        "checkpoint names in its config.json (speculative_token_map), else the whole "
        "vocabulary; 'none': the whole vocabulary",
    )
    constrained_json_disable_any_whitespace: bool = setting(
        False, "structured JSON output in compact layout (no free whitespace between tokens)"
    )
    tp_size: int = setting(
        1, "tensor-parallel ranks: attention heads, vocabulary and dense MLPs split", "--tp"
    )
    ep_size: int = setting(
        1,
        "expert-parallel ranks: routed experts split in blocks (a replica runs on "
        "max(tp, ep) ranks, each expert's width split over the rest)",
        "--ep",
    )
    nnodes: int = setting(1, "machines one replica spans")
    node_rank: int = setting(0, "this machine's index among --nnodes (node 0 serves HTTP)")
    dist_init_addr: str | None = setting(
        None, "HOST:PORT where rank 0 listens for the others (default: a free loopback port)"
    )
    dist_timeout: int = setting(
        120, "seconds a rendezvous or a collective may wait for the other ranks"
    )
    rank_heartbeat_timeout: float = setting(
        20.0, "seconds a rank may go silent before the replica stops with an error naming it"
    )
    max_n: int = setting(DEFAULT_MAX_N, "most choices (n) one request may ask for")
    max_top_logprobs: int = setting(
        DEFAULT_MAX_TOP_LOGPROBS,
        "most alternatives per token a request may ask for (/generate top_logprobs_num; the "
        "OpenAI routes also keep OpenAI's own bounds: logprobs <= 5, top_logprobs <= 20), "
        "as vLLM's --max-logprobs",
    )
    max_logprob_entries: int = setting(
        DEFAULT_MAX_LOGPROB_ENTRIES,
        "most logprob entries one response may carry: (prompt tokens scored + max_new_tokens) "
        "x (1 + top_logprobs_num + len(token_ids_logprob)), summed over n choices and batch "
        "prompts; a request past it gets a 400 (docs/serving_limits.md)",
    )
    disable_cuda_graph: bool = setting(
        False,
        "run decode, verify and draft steps eagerly instead of replaying captured graphs "
        f"(torch.compile graphs on CPU, CUDA graphs on GPU; also off when ${DISABLE_ENV} is set)",
    )
    cuda_graph_max_bs: int | None = setting(
        None, "largest captured batch size (default: --max-running-requests)"
    )
    cuda_graph_bs: list[int] | None = setting(
        None,
        "captured batch sizes (default 1, 2, 4, 8, 12, 16, 24, 32, ... up to the max; sizes "
        "above the max give way to the max itself, as in SGLang)",
    )
    enable_torch_compile: bool = setting(
        False,
        "CUDA: torch.compile the captured steps before graph capture (on CPU the capture is "
        "always a compile)",
    )
    disable_narrow_weights: bool = setting(
        False,
        "CPU: captured steps read the fp32 weights instead of bf16 copies of those whose values "
        "bf16 holds exactly (a bf16 checkpoint run in fp32: routed experts, linear layers and "
        "LM heads); the copies halve the bytes those products read and cost half their fp32 "
        "weights' memory",
    )
    disable_fused_nextn_round: bool = setting(
        False,
        "run each greedy NEXTN round as separate captured steps (target verify, then the "
        "draft's round) instead of one graph that also accepts the drafts",
    )
    capture_compile: str = setting(
        "background",
        "when a batch bucket's graph is built: background (its steps run eagerly until it is "
        "ready), inline (the first step that needs it waits) or startup (every step kind at "
        "every bucket before the engine serves, as SGLang captures at start-up; a NEXTN "
        "engine measuring where speculation pays then times both decode modes at each)",
    )

    # checks ------------------------------------------------------------------------------
    def capture_off_reason(self) -> str | None:
        """Why decode, verify and draft steps run eagerly; None when they are captured."""
        if self.disable_cuda_graph:
            return "--disable-cuda-graph"
        if CaptureConfig.disabled_by_env():
            return f"${DISABLE_ENV} is set"
        return None

    def capture_config(self) -> CaptureConfig:
        return CaptureConfig(
            enabled=self.capture_off_reason() is None,
            batch_sizes=tuple(self.cuda_graph_bs or ()),
            max_batch_size=self.cuda_graph_max_bs,
            torch_compile=self.enable_torch_compile,
            # the ranks of a replica compile each step in lockstep (the compile runs it, and
            # its collectives, on every rank): in the serving thread, when a batch needs it
            background=(
                self.capture_compile == "background" and self.parallel_layout().world_size == 1
            ),
            narrow_weights=not self.disable_narrow_weights,
            fused_round=not self.disable_fused_nextn_round,
        )

    def speculative_config(self) -> SpeculativeConfig | None:
        """The resolved speculative shape, None when speculation is off (ValueError if bad);
        the token map's `auto` resolves against this checkpoint."""
        return SpeculativeConfig.resolve(
            self.speculative_algorithm,
            self.speculative_num_steps,
            self.speculative_eagle_topk,
            self.speculative_num_draft_tokens,
            self.speculative_disable_by_batch_size,
            self.speculative_token_map,
            self.model_path or default_model_path(),
        )

    def parallel_layout(self) -> ParallelLayout:
        return ParallelLayout(self.tp_size, self.ep_size)

    def resolve(self):
        """Fill the defaults that depend on other settings and reject bad ones, in place
        (ValueError; FileNotFoundError for a missing checkpoint). Returns self."""
        self.model_path = str(self.model_path) if self.model_path else default_model_path()
        if not Path(self.model_path).is_dir():
            raise FileNotFoundError(
                f"--model-path '{self.model_path}' does not exist or is not a directory"
            )
        spec = self.speculative_config()
        if spec:
            self.speculative_algorithm, self.speculative_num_steps = spec.algorithm, spec.num_steps
            self.speculative_eagle_topk = spec.eagle_topk
            self.speculative_num_draft_tokens = spec.num_draft_tokens
        if self.max_running_requests is None:
            self.max_running_requests = (
                SPECULATIVE_MAX_RUNNING_REQUESTS if spec else DEFAULT_MAX_RUNNING_REQUESTS
            )
        if self.radix_snapshot_slots is None and self.max_running_requests >= 1:
            self.radix_snapshot_slots = 2 * self.max_running_requests
        for ok, message in self._checks():
            if not ok:
                raise ValueError(message)
        return self

    def _parallel_checks(self) -> list[tuple[bool, str]]:
        world = self.parallel_layout().world_size  # ValueError for a bad tp/ep pair
        if self.dist_init_addr is not None:
            parse_address(self.dist_init_addr)  # ValueError for a malformed address
        return [
            (self.nnodes >= 1, "--nnodes must be >= 1"),
            (
                0 <= self.node_rank < self.nnodes,
                f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}",
            ),
            (
                world % self.nnodes == 0,
                f"a replica of {world} ranks does not split over --nnodes {self.nnodes}",
            ),
            (
                self.nnodes == 1 or self.dist_init_addr is not None,
                "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)",
            ),
            (self.dist_timeout >= 1, "--dist-timeout must be >= 1 second"),
            (self.rank_heartbeat_timeout > 0, "--rank-heartbeat-timeout must be > 0"),
        ]

    def _checks(self) -> list[tuple[bool, str]]:
        chunk = self.chunked_prefill_size
        dtypes = ", ".join(SUPPORTED_DTYPES)
        return self._parallel_checks() + [
            (
                _known_dtype(self.dtype),
                f"--dtype '{self.dtype}' is not supported; use one of {dtypes}",
            ),
            (
                self.quantization in QUANTIZATION_CHOICES,
                f"--quantization '{self.quantization}' is not supported; use one of "
                f"{', '.join(QUANTIZATION_CHOICES)}",
            ),
            (self.page_size >= 1, f"--page-size must be >= 1, got {self.page_size}"),
            (self.max_running_requests >= 1, "--max-running-requests must be >= 1"),
            (self.max_total_tokens >= self.page_size, "--max-total-tokens must be >= --page-size"),
            (
                chunk is None or chunk == -1 or chunk >= 1,
                "--chunked-prefill-size must be -1 (off) or >= 1",
            ),
            (
                self.context_length is None or self.context_length >= 2,
                "--context-length must be >= 2",
            ),
            (self.radix_snapshot_interval >= 0, "--radix-snapshot-interval must be >= 0"),
            (
                self.radix_snapshot_slots is None or self.radix_snapshot_slots >= 1,
                "--radix-snapshot-slots must be >= 1",
            ),
            (self.max_n >= 1, f"--max-n must be >= 1, got {self.max_n}"),
            (self.max_top_logprobs >= 0, "--max-top-logprobs must be >= 0"),
            (self.max_logprob_entries >= 1, "--max-logprob-entries must be >= 1"),
            (
                self.capture_compile in CAPTURE_COMPILE_MODES,
                f"--capture-compile must be one of {', '.join(CAPTURE_COMPILE_MODES)}",
            ),
            (
                self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
                "--cuda-graph-max-bs must be >= 1",
            ),
            (
                all(b >= 1 for b in self.cuda_graph_bs or ()),
                "--cuda-graph-bs sizes must be >= 1",
            ),
        ]

    # command line ------------------------------------------------------------------------
    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, names: Iterable[str] | None = None
    ) -> None:
        """Add `--flag` per field (all, or those in `names`), defaults from the dataclass."""
        wanted = None if names is None else set(names)
        for f in dataclasses.fields(cls):
            if wanted is None or f.name in wanted:
                flags, options = cls.cli_argument(f.name)
                parser.add_argument(*flags, **options)

    @classmethod
    def cli_argument(cls, name: str) -> tuple[list[str], dict]:
        """The flag of field `name` as `parser.add_argument(*flags, **options)` takes it:
        its names, type, default and help, all from the field (a tool that adapts a flag,
        e.g. to sweep several values, starts from this instead of restating it)."""
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        hints = typing.get_type_hints(cls)
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        kind = [t for t in typing.get_args(hints[f.name]) if t is not type(None)]
        kind = kind[0] if kind else hints[f.name]
        options = dict(dest=f.name, default=f.default, help=_help_text(f))
        if typing.get_origin(kind) is list:
            options.update(nargs="+", type=typing.get_args(kind)[0])
        elif kind is bool:
            options.update(action="store_true")
        else:
            options.update(type=kind)
        return flags, options

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace, **overrides):
        """An instance from parsed flags; fields the parser lacks keep their defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(namespace).items() if k in names}
        return cls(**{**values, **overrides})

    def engine_fields(self) -> dict:
        """The `EngineConfig` settings of this object (also of a subclass such as ServerArgs)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
