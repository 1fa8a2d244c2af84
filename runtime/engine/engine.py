# SPDX-License-Identifier: Apache-2.0
"""`Engine`: load a checkpoint and generate, in process.

    engine = Engine(model_path="/ckpt", dtype="float32")
    out = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 16})
    out["text"], out["output_ids"], out["meta_info"]
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid

import torch

from runtime.cache.allocator import PagedTokenAllocator
from runtime.cache.req_to_token_pool import ReqToTokenPool
from runtime.cache.slot_table import SlotTable
from runtime.configs.model_config import ModelConfig
from runtime.configs.speculative import SpeculativeConfig
from runtime.engine.sampling_params import InvalidRequestError, SamplingParams
from runtime.engine.tokenizer import load_tokenizer
from runtime.execution.model_runner import ModelRunner
from runtime.execution.worker import PlainWorker
from runtime.models.registry import model_classes, resolve_model_class
from runtime.scheduler.request import FinishReason, Req
from runtime.scheduler.scheduler import Scheduler
from runtime.speculative.drafter import MTPDrafter
from runtime.speculative.nextn_worker import NextNWorker

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, model_path: str | None = None, dtype: str = "auto", tokenizer_path: str | None = None,
                 page_size: int = 1, max_total_tokens: int = 65536, max_running_requests: int = 64,
                 context_length: int | None = None, random_seed: int | None = None,
                 skip_tokenizer_init: bool = False, device: str = "cpu", progress: bool = False,
                 speculative_algorithm: str | None = None, speculative_num_steps: int | None = None,
                 speculative_eagle_topk: int | None = None,
                 speculative_num_draft_tokens: int | None = None):
        if model_path is None:
            raise ValueError("no model_path given and no embedded default model is installed yet")
        self.spec_config = SpeculativeConfig.resolve(speculative_algorithm, speculative_num_steps,
                                                     speculative_eagle_topk, speculative_num_draft_tokens)
        self.model_config = ModelConfig.from_path(model_path, dtype, context_length)
        self.context_length = self.model_config.context_length
        target_cls = resolve_model_class(self.model_config.architectures)
        draft_cls = self._draft_class(target_cls) if self.spec_config else None
        pass_width = self.spec_config.num_draft_tokens if self.spec_config else 1
        num_pages = max(1, max_total_tokens // page_size)
        # room for positions a speculative round writes past the context end
        max_context = min(self.context_length, num_pages * page_size) + 2 * pass_width + page_size
        self.slot_table = SlotTable(ReqToTokenPool(max_running_requests, max_context, device),
                                    PagedTokenAllocator(num_pages, page_size, device))
        self.runner = ModelRunner(self.model_config, self.slot_table, pass_width, model_cls=target_cls,
                                  device=device, progress=progress)
        generator = torch.Generator().manual_seed(random_seed) if random_seed is not None else None
        if self.spec_config:
            draft = ModelRunner(self.model_config, self.slot_table, pass_width, model_cls=draft_cls,
                                device=device, progress=progress)
            draft.model.set_embed_and_head(*self.runner.model.get_embed_and_head())
            self.worker = NextNWorker(self.runner, MTPDrafter(draft, self.spec_config.num_steps),
                                      self.spec_config, generator)
        else:
            self.worker = PlainWorker(self.runner, generator)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(tokenizer_path or model_path)
        self.scheduler = Scheduler(self.worker, self.slot_table, self.model_config.eos_token_ids,
                                   max_running_requests)
        self._ids = itertools.count()
        logger.info("KV cache: %d token slots in pages of %d, %d request slots; speculative: %s",
                    self.slot_table.allocator.capacity_tokens, page_size, max_running_requests,
                    self.spec_config)

    def _draft_class(self, target_cls: type) -> type:
        name = getattr(target_cls, "draft_architecture", None)
        layers = getattr(self.model_config.hf_config, "num_nextn_predict_layers", 0) or 0
        if name is None or name not in model_classes() or layers < 1:
            raise ValueError(f"{target_cls.__name__} checkpoint at '{self.model_config.model_path}' has no "
                             "MTP (NextN) draft layer (num_nextn_predict_layers = 0): use a checkpoint "
                             "with `mtp.*` weights or drop --speculative-algorithm")
        return model_classes()[name]

    @property
    def avg_spec_accept_length(self) -> float | None:
        return self.worker.stats.avg_accept_length if self.spec_config else None

    # requests -----------------------------------------------------------------------------
    def _prompt_ids(self, prompt, input_ids) -> list[list[int]]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("pass exactly one of prompt (text) or input_ids")
        if input_ids is not None:
            batch = input_ids if input_ids and isinstance(input_ids[0], list) else [input_ids]
        else:
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer; pass input_ids instead of text")
            texts = prompt if isinstance(prompt, list) else [prompt]
            batch = [self.tokenizer.encode(t) for t in texts]
        for ids in batch:
            if not ids:
                raise InvalidRequestError("empty prompt: send at least one token")
            if any(not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size for t in ids):
                raise InvalidRequestError(f"input_ids must be token ids in [0, {self.model_config.vocab_size})")
        return batch

    def _make_req(self, ids: list[int], params: SamplingParams) -> Req:
        if len(ids) >= self.context_length:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; the context length is "
                                      f"{self.context_length}")
        room = self.context_length - len(ids)
        if params.max_new_tokens > room:
            params = SamplingParams(**{**params.to_dict(), "max_new_tokens": room})
        return Req(f"{uuid.uuid4().hex[:8]}-{next(self._ids)}", ids, params)

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list | None = None,
                 input_ids: list[int] | list[list[int]] | None = None) -> dict | list[dict]:
        """Greedy (`temperature=0`) or sampled generation; one dict per prompt."""
        batch = self._prompt_ids(prompt, input_ids)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(batch):
                raise InvalidRequestError("sampling_params list must have one entry per prompt")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(batch)
        reqs = [self._make_req(ids, p) for ids, p in zip(batch, params)]
        for req in reqs:
            if req.sampling_params.max_new_tokens == 0:
                req.finish_reason = FinishReason("length", length=0)
            else:
                self.scheduler.add_request(req)
        while self.scheduler.has_work():
            self.scheduler.step()
        results = [self._result(r) for r in reqs]
        single = not isinstance(prompt, list) and not (input_ids and isinstance(input_ids[0], list))
        return results[0] if single else results

    def _result(self, req: Req) -> dict:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_ids,
                                         skip_special_tokens=req.sampling_params.skip_special_tokens)
        finished_at = req.finished_at or time.perf_counter()
        return {
            "text": text,
            "output_ids": list(req.output_ids),
            "meta_info": {
                "id": req.rid,
                "finish_reason": req.finish_reason.to_json() if req.finish_reason else None,
                "prompt_tokens": len(req.prompt_ids),
                "completion_tokens": len(req.output_ids),
                "cached_tokens": 0,
                "e2e_latency": finished_at - req.created_at,
                **self._spec_meta(req),
            },
        }

    def _spec_meta(self, req: Req) -> dict:
        if not self.spec_config:
            return {}
        rounds = req.spec_verify_ct
        return {
            "spec_verify_ct": rounds,
            "spec_accept_length": len(req.output_ids) / rounds if rounds else 0.0,
            "spec_accept_histogram": list(req.spec_accept_hist) or [0] * self.spec_config.num_draft_tokens,
        }
