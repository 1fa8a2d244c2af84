# SPDX-License-Identifier: Apache-2.0
"""`Engine`: load a checkpoint and generate, in process.

    engine = Engine(model_path="/ckpt", dtype="float32")
    out = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 16})
    out["text"], out["output_ids"], out["meta_info"]

The engine is single-threaded: `add_request` / `step` / `abort` drive it one step at a
time (the HTTP server runs them on a background thread, see `AsyncEngine`); `generate`
is the blocking convenience on top.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from pathlib import Path

import torch

from runtime.cache.allocator import PagedTokenAllocator
from runtime.cache.req_to_token_pool import ReqToTokenPool
from runtime.cache.slot_table import SlotTable
from runtime.configs.capture import CaptureConfig
from runtime.configs.model_config import ModelConfig
from runtime.configs.speculative import SpeculativeConfig
from runtime.core.errors import InvalidRequestError
from runtime.core.request import FinishReason, Req
from runtime.core.sampling_params import SamplingParams
from runtime.engine.tokenizer import load_tokenizer
from runtime.execution.model_runner import ModelRunner
from runtime.execution.worker import PlainWorker
from runtime.model_loader.build import load_model
from runtime.models.registry import model_classes, resolve_model_class
from runtime.scheduler.detokenizer import IncrementalDetokenizer
from runtime.scheduler.scheduler import Scheduler
from runtime.speculative.drafter import MTPDrafter
from runtime.speculative.nextn_worker import NextNWorker

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "deepseek_v4_tiny"


def default_model_path() -> str:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"no --model-path given and the embedded default model is missing at "
            f"{DEFAULT_MODEL_DIR}; pass --model-path or reinstall the package"
        )
    return str(DEFAULT_MODEL_DIR)


class Engine:
    def __init__(
        self,
        model_path: str | None = None,
        dtype: str = "auto",
        tokenizer_path: str | None = None,
        page_size: int = 1,
        max_total_tokens: int = 65536,
        max_running_requests: int = 64,
        chunked_prefill_size: int | None = None,
        context_length: int | None = None,
        random_seed: int | None = None,
        skip_tokenizer_init: bool = False,
        device: str = "cpu",
        progress: bool = False,
        speculative_algorithm: str | None = None,
        speculative_num_steps: int | None = None,
        speculative_eagle_topk: int | None = None,
        speculative_num_draft_tokens: int | None = None,
        capture: CaptureConfig | None = None,
    ):
        model_path = model_path or default_model_path()
        self.spec_config = SpeculativeConfig.resolve(
            speculative_algorithm,
            speculative_num_steps,
            speculative_eagle_topk,
            speculative_num_draft_tokens,
        )
        if page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {page_size}")
        if max_running_requests < 1 or max_total_tokens < page_size:
            raise ValueError(
                "--max-running-requests must be >= 1 and --max-total-tokens >= --page-size"
            )
        self.model_path = model_path
        self.model_config = ModelConfig.from_path(model_path, dtype, context_length)
        self.context_length = self.model_config.context_length
        target_cls = resolve_model_class(self.model_config.architectures)
        draft_cls = self._draft_class(target_cls) if self.spec_config else None
        pass_width = self.spec_config.num_draft_tokens if self.spec_config else 1
        num_pages = max_total_tokens // page_size
        # room for the positions a speculative round writes past the context end
        max_context = min(self.context_length, num_pages * page_size) + 2 * pass_width + page_size
        self.slot_table = SlotTable(
            ReqToTokenPool(max_running_requests, max_context, device),
            PagedTokenAllocator(num_pages, page_size, device),
        )
        self.runner = ModelRunner(
            load_model(self.model_config, target_cls, progress=progress),
            self.model_config,
            self.slot_table,
            pass_width,
            device=device,
            capture=capture,
        )
        self.eos_ids = eos_ids = set(
            self.model_config.eos_token_ids
        )  # shared by worker and scheduler
        generator = torch.Generator().manual_seed(random_seed) if random_seed is not None else None
        if self.spec_config:
            draft = ModelRunner(
                load_model(self.model_config, draft_cls, progress=progress),
                self.model_config,
                self.slot_table,
                pass_width,
                device=device,
                capture=capture,
            )
            draft.model.set_embed_and_head(*self.runner.model.get_embed_and_head())
            self.worker = NextNWorker(
                self.runner,
                MTPDrafter(draft, self.spec_config.num_steps),
                self.spec_config,
                eos_ids,
                generator,
            )
        else:
            self.worker = PlainWorker(self.runner, eos_ids, generator)
        self.tokenizer = (
            None if skip_tokenizer_init else load_tokenizer(tokenizer_path or model_path)
        )
        self.scheduler = Scheduler(
            self.worker, self.slot_table, eos_ids, max_running_requests, chunked_prefill_size
        )
        self.capacity = {
            "max_total_tokens": self.slot_table.allocator.capacity_tokens,
            "page_size": page_size,
            "max_running_requests": max_running_requests,
            "kv_cache_bytes": self.runner.kv_pool.nbytes(),
        }
        self._ids = itertools.count()
        logger.info(
            "KV cache: %d token slots in pages of %d, %d request slots, %.1f MiB; speculative: %s",
            self.capacity["max_total_tokens"],
            page_size,
            max_running_requests,
            self.capacity["kv_cache_bytes"] / 2**20,
            self.spec_config,
        )

    def _draft_class(self, target_cls: type) -> type:
        name = getattr(target_cls, "draft_architecture", None)
        if (
            name is None
            or name not in model_classes()
            or not target_cls.has_draft_layers(self.model_config.hf_config)
        ):
            raise ValueError(
                f"{target_cls.__name__} checkpoint at '{self.model_config.model_path}' has no "
                "MTP (NextN) draft layer in its config: use a checkpoint "
                "with `mtp.*` weights or drop --speculative-algorithm"
            )
        return model_classes()[name]

    @property
    def avg_spec_accept_length(self) -> float | None:
        return self.worker.stats.avg_accept_length if self.spec_config else None

    # requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this engine has no tokenizer; send input_ids instead of text"
            )
        return self.tokenizer.encode(prompt)

    def check_input_ids(self, ids) -> list[int]:
        if not isinstance(ids, list) or not ids:
            raise InvalidRequestError("empty prompt: send at least one token")
        vocab = self.model_config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"input_ids must be token ids in [0, {vocab})")
        if len(ids) >= self.context_length:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but the context length is "
                f"{self.context_length}; shorten the prompt"
            )
        return ids

    def make_request(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | dict | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
    ) -> Req:
        """Validate and build a request (not queued yet)."""
        params = SamplingParams.from_dict(sampling_params)
        ids = self.check_input_ids(input_ids)
        if len(ids) + params.max_new_tokens > self.context_length:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length {self.context_length}; lower max_new_tokens"
            )
        if params.stop_strings and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids")
        if top_logprobs_num < 0 or top_logprobs_num > self.model_config.vocab_size:
            raise InvalidRequestError(
                f"top_logprobs_num must be in [0, {self.model_config.vocab_size}]"
            )
        if logprob_start_len >= len(ids):
            raise InvalidRequestError(
                f"logprob_start_len {logprob_start_len} must be < the prompt length {len(ids)}"
            )
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
            )
        return Req(
            rid or f"{uuid.uuid4().hex[:12]}-{next(self._ids)}",
            list(ids),
            params,
            return_logprob=return_logprob or top_logprobs_num > 0,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len if return_logprob else -1,
            detokenizer=detok,
        )

    def add_request(self, req: Req) -> None:
        if req.sampling_params.max_new_tokens == 0:
            req.finish(FinishReason("length", length=0))
            return
        self.scheduler.add_request(req)

    def step(self) -> list[Req]:
        return self.scheduler.step()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, rid: str, message: str = "aborted by the client") -> Req | None:
        return self.scheduler.abort(rid, message)

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
    ) -> dict | list[dict]:
        """Blocking generation; one result dict per prompt (a list of `n` per prompt if n > 1)."""
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("pass exactly one of prompt (text) or input_ids")
        batched = isinstance(prompt, list) or bool(input_ids and isinstance(input_ids[0], list))
        if input_ids is not None:
            prompts = input_ids if batched else [input_ids]
        else:
            prompts = [self.tokenize(p) for p in (prompt if batched else [prompt])]
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise InvalidRequestError("sampling_params list must have one entry per prompt")
        groups = []
        for ids, p in zip(prompts, params):
            parsed = SamplingParams.from_dict(p)
            groups.append(
                [
                    self.make_request(
                        ids,
                        parsed,
                        return_logprob=return_logprob,
                        top_logprobs_num=top_logprobs_num,
                        logprob_start_len=logprob_start_len,
                    )
                    for _ in range(parsed.n)
                ]
            )
        for group in groups:
            for req in group:
                self.add_request(req)
        while self.has_work():
            self.step()
        results = [[self.result(r) for r in g] for g in groups]
        results = [r[0] if len(r) == 1 else r for r in results]
        return results if batched else results[0]

    # results ------------------------------------------------------------------------------
    def result(self, req: Req) -> dict:
        """SGLang's `/generate` shape: text, output_ids, meta_info."""
        meta = {
            "id": req.rid,
            "finish_reason": req.finish_reason.to_json() if req.finish_reason else None,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "e2e_latency": (req.finished_at or time.perf_counter()) - req.created_at,
            **self._spec_meta(req),
        }
        if req.return_logprob:
            meta.update(self._logprob_meta(req))
        return {
            "text": req.text if self.tokenizer is not None else None,
            "output_ids": list(req.output_ids),
            "meta_info": meta,
        }

    def _logprob_meta(self, req: Req) -> dict:
        def triple(lp, tid):
            return [lp, tid, None]

        return {
            "input_token_logprobs": [triple(lp, t) for lp, t in req.input_token_logprobs],
            "output_token_logprobs": [triple(lp, t) for lp, t in req.output_token_logprobs],
            "input_top_logprobs": [None] * len(req.input_token_logprobs)
            if req.top_logprobs_num
            else [],
            "output_top_logprobs": [
                [triple(lp, t) for lp, t in top] for top in req.output_top_logprobs
            ],
        }

    def _spec_meta(self, req: Req) -> dict:
        if not self.spec_config:
            return {}
        rounds = req.spec_verify_ct
        return {
            "spec_verify_ct": rounds,
            "spec_accept_length": len(req.output_ids) / rounds if rounds else 0.0,
            "spec_accept_histogram": list(req.spec_accept_hist)
            or [0] * self.spec_config.num_draft_tokens,
        }

    def server_info(self) -> dict:
        stats = self.worker.stats if self.spec_config else None
        return {
            "model_path": self.model_path,
            "context_length": self.context_length,
            **self.capacity,
            "speculative_algorithm": self.spec_config.algorithm if self.spec_config else None,
            "speculative_num_steps": self.spec_config.num_steps if self.spec_config else None,
            "speculative_eagle_topk": self.spec_config.eagle_topk if self.spec_config else None,
            "speculative_num_draft_tokens": self.spec_config.num_draft_tokens
            if self.spec_config
            else None,
            "internal_states": [
                {
                    "avg_spec_accept_length": stats.avg_accept_length if stats else None,
                    "spec_acceptance_rate_per_position": stats.acceptance_rate_per_position()
                    if stats
                    else None,
                    # raw counters, so a client can take the accept length over its own window
                    "spec_verify_rounds": stats.verify_rounds if stats else None,
                    "spec_emitted_tokens": stats.emitted_tokens if stats else None,
                    "num_running_reqs": len(self.scheduler.running),
                    "num_waiting_reqs": len(self.scheduler.waiting),
                    "num_retractions": self.scheduler.num_retractions,
                    "available_tokens": self.slot_table.allocator.available_tokens(),
                    "available_request_slots": self.slot_table.req_pool.available(),
                    "token_usage": 1
                    - self.slot_table.allocator.available_tokens()
                    / max(1, self.slot_table.allocator.capacity_tokens),
                }
            ],
        }
