# SPDX-License-Identifier: Apache-2.0
"""`Engine`: load a checkpoint and generate, in process.

    engine = Engine(model_path="/ckpt", dtype="float32")   # or Engine(EngineConfig(...))
    out = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 16})
    out["text"], out["output_ids"], out["meta_info"]

The engine is single-threaded: `add_request` / `step` / `abort` drive it one step at a
time (the HTTP server runs them on a background thread, see `AsyncEngine`); `generate`
is the blocking convenience on top, shaped like nano-vllm's `LLMEngine.generate` and
returning `sglang.Engine.generate`'s dicts. Inside the runtime a request's outcome is the
typed `RequestResult` (`request_result`); `result` renders it as SGLang's dict.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import uuid

import torch

from runtime.cache.prefix_cache import PrefixCache, RadixPrefixCache
from runtime.configs.capture import CaptureConfig
from runtime.configs.compiler_caches import point_compiler_caches
from runtime.configs.engine_config import DEFAULT_MODEL_DIR, EngineConfig, default_model_path
from runtime.core.errors import InvalidRequestError
from runtime.core.request import FinishReason, Req
from runtime.core.result import RequestResult
from runtime.core.sampling_params import SamplingParams
from runtime.core.stats import EngineInfo, EngineStats
from runtime.core.stop_strings import StopStrings
from runtime.engine.capture_warmup import compile_at_startup
from runtime.engine.fanout import fan_out
from runtime.engine.host_malloc import keep_freed_memory
from runtime.engine.ranks import RankMemory, ReplicaLeader, memory_report
from runtime.engine.request_limits import RequestLimits, longest_token_chars
from runtime.engine.results import engine_stats, request_result
from runtime.engine.setup import engine_setup, with_resolved_dtype
from runtime.engine.sglang_output import render_generate
from runtime.engine.tokenizer import load_tokenizer
from runtime.engine.worker_factory import build_worker
from runtime.scheduler.detokenizer import IncrementalDetokenizer
from runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MODEL_DIR", "Engine", "default_model_path"]


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, progress: bool = False, **overrides):
        """`config` (default `EngineConfig()`) with `overrides` applied, e.g.
        `Engine(model_path=..., dtype="float32", speculative_algorithm="NEXTN")`."""
        config = dataclasses.replace(config or EngineConfig(), **overrides).resolve()
        multi_rank = config.parallel_layout().world_size > 1
        if multi_rank:  # every rank must load the dtype rank 0 chose
            config = with_resolved_dtype(config)
        self.config, self.model_path = config, config.model_path
        self.num_finished_reqs = 0
        # before anything compiles, and before the replica's other ranks inherit the env
        point_compiler_caches(config.capture_config().resolved_cache_dir())
        # rank 0 of a multi-rank replica: the other ranks start (and are watched) from here
        self.leader = ReplicaLeader(config) if multi_rank else None
        try:
            self._build(config, progress)
            if config.capture_compile == "startup" and multi_rank:
                # start-up compiles each bucket on rank 0 alone, outside any forward the
                # other ranks follow; a replica's ranks compile a step together when a
                # batch first needs it
                logger.warning(
                    "--capture-compile startup: a replica's ranks compile each captured "
                    "step together the first time a batch needs it instead"
                )
            elif config.capture_compile == "startup":
                compile_at_startup(self, progress=progress)
        except BaseException:
            if self.leader is not None:
                self.leader.shutdown()
            raise

    def _build(self, config: EngineConfig, progress: bool) -> None:
        leader = self.leader
        device = leader.device if leader is not None else config.device
        if torch.device(device).type == "cpu":
            keep_freed_memory()
        setup = engine_setup(config, device)
        self.spec_config, self.model_config = setup.spec_config, setup.model_config
        self.context_length = self.model_config.context_length
        self.slot_table = setup.slot_table
        self.eos_ids = set(self.model_config.eos_token_ids)  # shared by worker and scheduler
        generator = None
        if config.random_seed is not None:
            # on the engine's device: torch draws from a generator only on its own device
            generator = torch.Generator(device=device).manual_seed(config.random_seed)
        self.runner, self.worker = build_worker(
            self.model_config,
            self.slot_table,
            self.spec_config,
            self.eos_ids,
            generator,
            device=device,
            progress=progress,
            mapping=leader.mapping if leader is not None else None,
            broadcaster=leader.attach(self.slot_table.req_to_token) if leader else None,
            snapshot_slots=setup.snapshot_slots,
            capture=self._capture_config(config),
            max_pass_rows=config.chunked_prefill_size,
        )
        runners = self._runners()
        self.rank_memory: list[RankMemory] = (
            leader.gather_memory(runners) if leader is not None else [memory_report(0, runners)]
        )
        self.tokenizer = (
            None
            if config.skip_tokenizer_init
            else load_tokenizer(config.tokenizer_path or config.model_path)
        )
        self.prefix_cache = self._prefix_cache()
        self.scheduler = Scheduler(
            self.worker,
            self.slot_table,
            self.eos_ids,
            config.max_running_requests,
            config.chunked_prefill_size,
            self.prefix_cache,
            step_failure_is_fatal=self._replica_out_of_step,
        )
        self.info = self._info()
        self.limits = RequestLimits(
            vocab_size=self.model_config.vocab_size,
            context_length=self.context_length,
            max_n=config.max_n,
            max_top_logprobs=config.max_top_logprobs,
            max_logprob_entries=config.max_logprob_entries,
            max_text_chars=None
            if self.tokenizer is None
            else self.context_length * longest_token_chars(self.tokenizer),
        )
        self._ids = itertools.count()
        self._grammar_backend = None
        self._grammar_lock = threading.Lock()
        logger.info(
            "KV cache: %d token slots in pages of %d, %d request slots, %.1f MiB; speculative: "
            "%s; prefix cache: %s",
            self.info.max_total_tokens,
            self.info.page_size,
            self.info.max_running_requests,
            self.info.kv_cache_bytes / 2**20,
            self.spec_config,
            self.prefix_cache.describe(),
        )

    def _runners(self) -> list:
        """The model runners: the target's, then the MTP draft's when speculating."""
        speculation = self.worker.speculation
        return [self.runner] + ([] if speculation is None else [speculation.drafter.runner])

    @staticmethod
    def _capture_config(config: EngineConfig) -> CaptureConfig:
        """The capture settings, with the reason logged when steps run eagerly (a warning
        when it is not the user's choice)."""
        reason = config.capture_off_reason()
        if reason is not None:
            chosen = config.disable_cuda_graph or CaptureConfig.disabled_by_env()
            level = logging.INFO if chosen else logging.WARNING
            logger.log(level, "captured steps off: %s", reason)
        return config.capture_config()

    def _prefix_cache(self) -> PrefixCache:
        """The radix cache over every runner a request's state lives in: the target's and,
        when speculating, the MTP draft's (so a resumed request drafts as well as a fresh
        one), or no sharing with `disable_radix_cache`."""
        if self.config.disable_radix_cache:
            return PrefixCache(self.slot_table)
        runners = self._runners()
        speculation = self.worker.speculation
        reach = None if speculation is None else speculation.drafter.runner.model.kv_reach
        return RadixPrefixCache(
            self.slot_table,
            runners,
            snapshot_slots=self.config.radix_snapshot_slots,
            snapshot_interval=self.config.radix_snapshot_interval,
            owed_capacity=reach,  # a window-only draft owes a state at most its window of rows
            # a draft reading every row keeps its rows in the shared pages
            next_token_keys=self.spec_config is not None and reach is None,
        )

    def _info(self) -> EngineInfo:
        spec = self.spec_config
        return EngineInfo(
            model_path=self.model_path,
            context_length=self.context_length,
            max_total_tokens=self.slot_table.allocator.capacity_tokens,
            page_size=self.config.page_size,
            max_running_requests=self.config.max_running_requests,
            kv_cache_bytes=self.runner.kv_pool.nbytes(),
            speculative_algorithm=spec.algorithm if spec else None,
            speculative_num_steps=spec.num_steps if spec else None,
            speculative_eagle_topk=spec.eagle_topk if spec else None,
            speculative_num_draft_tokens=spec.num_draft_tokens if spec else None,
            speculative_disable_by_batch_size=spec.describe_limit() if spec else None,
            speculative_token_map=spec.token_map if spec else None,
            rank_memory=tuple(report.to_json() for report in self.rank_memory),
        )

    @property
    def avg_spec_accept_length(self) -> float | None:
        speculation = self.worker.speculation
        return None if speculation is None else speculation.stats.avg_accept_length

    @property
    def bos_token_id(self) -> int:
        return getattr(self.model_config.hf_config, "bos_token_id", None) or 0

    # requests -----------------------------------------------------------------------------
    def tokenize(
        self, prompt: str, param: str = "text", add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of `prompt`; a 400 naming `param` for text no prompt can be made of
        (lone surrogates, longer than the context could hold). Safe off the engine thread."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this engine has no tokenizer; send input_ids instead of text", param=param
            )
        self.limits.check_text(prompt, param)
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def check_input_ids(self, ids, param: str = "input_ids") -> list[int]:
        return self.limits.check_prompt_ids(ids, param)

    def token_texts(self, token_ids) -> list[str]:
        """The text of each token alone, special tokens included (SGLang's text slot of a
        logprob entry: `tokenizer.batch_decode([[id] for id in ids])`)."""
        if self.tokenizer is None:
            return [None] * len(token_ids)
        return self.tokenizer.batch_decode([[t] for t in token_ids])

    def grammar_backend(self):
        """xgrammar over the served tokenizer, built on the first structured-output request."""
        if self._grammar_backend is None:
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured output (json_schema, regex, ebnf) needs a tokenizer; "
                    "this server runs with --skip-tokenizer-init"
                )
            from runtime.constrained.backend import GrammarBackend

            with self._grammar_lock:
                if self._grammar_backend is None:
                    self._grammar_backend = GrammarBackend(
                        self.tokenizer,
                        self.model_config.vocab_size,
                        self.eos_ids,
                        any_whitespace=not self.config.constrained_json_disable_any_whitespace,
                    )
        return self._grammar_backend

    def make_request(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | dict | None = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        token_ids_logprob: list[int] | None = None,
        return_text_in_logprobs: bool = False,
        parent_rid: str | None = None,
    ) -> Req:
        """Validate and build one request (not queued yet). Every check a value could fail
        inside a step is made here (see `request_limits`). A request with a grammar
        compiles it here (cached per schema): call this off the event loop."""
        params = SamplingParams.from_dict(sampling_params)
        self.limits.check_rid(rid)
        ids = self.check_input_ids(input_ids)
        if params.max_new_tokens is None:  # SGLang: as many as the context leaves
            params = dataclasses.replace(
                params, max_new_tokens=max(0, self.context_length - len(ids))
            )
        if len(ids) + params.max_new_tokens > self.context_length:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length {self.context_length}; lower max_new_tokens",
                param="max_new_tokens",
            )
        self.limits.check_stops(params)
        if params.stop_strings and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a tokenizer; use stop_token_ids", param="stop"
            )
        for name, flag in (
            ("return_logprob", return_logprob),
            ("return_text_in_logprobs", return_text_in_logprobs),
        ):
            if not isinstance(flag, bool):
                raise InvalidRequestError(f"{name} must be true or false, got {flag!r}", param=name)
        self.limits.check_top_logprobs(top_logprobs_num)
        if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int):
            raise InvalidRequestError(
                "logprob_start_len must be an integer", param="logprob_start_len"
            )
        if logprob_start_len > len(ids):
            raise InvalidRequestError(
                f"logprob_start_len {logprob_start_len} must be <= the prompt length {len(ids)}",
                param="logprob_start_len",
            )
        if token_ids_logprob is not None:
            if not isinstance(token_ids_logprob, list):
                raise InvalidRequestError(
                    "token_ids_logprob must be a list of token ids", param="token_ids_logprob"
                )
            self.limits.check_token_ids(token_ids_logprob, "token_ids_logprob")
        grammar = None
        if params.grammar is not None:
            grammar = self.grammar_backend().request_grammar(*params.grammar)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
            )
        return_logprob = (
            bool(return_logprob) or top_logprobs_num > 0 or token_ids_logprob is not None
        )
        req = Req(
            rid or self._new_rid(),
            list(ids),
            params,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len if return_logprob else -1,
            token_ids_logprob=None if token_ids_logprob is None else list(token_ids_logprob),
            return_text_in_logprobs=bool(return_text_in_logprobs),
            detokenizer=detok,
            grammar=grammar,
            parent_rid=parent_rid,
            stop_matcher=StopStrings.of(tuple(params.stop_strings)) if params.stop else None,
        )
        self.limits.check_logprob_entries([req])
        self._check_admissible(req)
        return req

    def _check_admissible(self, req: Req) -> None:
        """The KV pool must hold what the scheduler reserves to admit `req` alone, else it
        could never run (SGLang rejects prompts past `max_total_tokens` the same way)."""
        need = self.scheduler.tokens_to_admit(req)
        capacity = self.slot_table.allocator.capacity_tokens
        if need > capacity:
            raise InvalidRequestError(
                f"the prompt has {len(req.prompt_ids)} tokens and admitting it takes {need} "
                f"token slots, but the KV cache holds {capacity}; shorten the prompt "
                "(or raise --max-total-tokens)",
                param="input_ids",
            )

    def make_requests(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | dict | None = None,
        rid: str | None = None,
        **request_options,
    ) -> list[Req]:
        """The `n` requests of one prompt (see `fanout`): ids `rid-k`, seeds offset by k."""
        params = SamplingParams.from_dict(sampling_params)
        self.limits.check_n(params.n)
        self.limits.check_rid(rid)
        rid = rid or self._new_rid()
        parent = rid if params.n > 1 else None
        reqs = [
            self.make_request(
                input_ids, choice, rid=choice_rid, parent_rid=parent, **request_options
            )
            for choice_rid, choice in fan_out(params, rid)
        ]
        self.limits.check_logprob_entries(reqs)  # every choice's logprobs in one response
        return reqs

    def _new_rid(self) -> str:
        return f"{uuid.uuid4().hex[:12]}-{next(self._ids)}"

    def add_request(self, req: Req) -> None:
        if req.sampling_params.max_new_tokens == 0 and not self._scores_prompt(req):
            req.finish(FinishReason("length", length=0))  # nothing to compute
            self.num_finished_reqs += 1
            return
        self.scheduler.add_request(req)

    @staticmethod
    def _scores_prompt(req: Req) -> bool:
        """The request wants logprobs of prompt tokens: its prefill must run."""
        return req.return_logprob and 0 <= req.logprob_start_len < len(req.prompt_ids)

    def step(self) -> list[Req]:
        try:
            touched = self.scheduler.step()
        except Exception as err:
            broadcaster = self.leader.broadcaster if self.leader is not None else None
            if broadcaster is not None and broadcaster.in_flight:
                # the other ranks are inside a forward rank 0 did not finish: they can no
                # longer be told apart from the next one, so the replica stops here
                self.leader.fail_in_forward(err)
            raise
        self.num_finished_reqs += sum(req.finished for req in touched)
        return touched

    def _replica_out_of_step(self, error: Exception) -> bool:
        """A step failed while the other ranks of the replica were inside its forward: the
        scheduler cannot re-run anything (see `step`)."""
        broadcaster = self.leader.broadcaster if self.leader is not None else None
        return broadcaster is not None and broadcaster.in_flight

    def shutdown(self) -> None:
        """Stop the other ranks of a multi-rank replica (nothing to do on one rank)."""
        if self.leader is not None:
            self.leader.shutdown()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, rid: str, message: str = "aborted by the client") -> Req | None:
        req = self.scheduler.abort(rid, message)
        self.num_finished_reqs += req is not None
        return req

    def abort_all(self, message: str) -> list[Req]:
        """Abort every waiting and running request (a shutdown, a scheduler failure)."""
        reqs = self.scheduler.abort_all(message)
        self.num_finished_reqs += len(reqs)
        return reqs

    def flush_cache(self) -> bool:
        """SGLang's `/flush_cache`: drop everything the prefix cache holds. Like SGLang it is
        refused (False) while requests are in flight."""
        if self.has_work():
            return False
        self.prefix_cache.reset()
        return True

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        token_ids_logprob: list[int] | None = None,
        return_text_in_logprobs: bool = False,
    ) -> dict | list:
        """Blocking generation; one result dict per prompt (a list of `n` per prompt if n > 1)."""
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("pass exactly one of prompt (text) or input_ids")
        batched = isinstance(prompt, list) or bool(input_ids and isinstance(input_ids[0], list))
        if input_ids is not None:
            prompts = input_ids if batched else [input_ids]
        else:
            texts = prompt if batched else [prompt]
            names = [f"prompt[{i}]" for i in range(len(texts))] if batched else ["prompt"]
            prompts = [self.tokenize(p, name) for p, name in zip(texts, names)]
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompts)
        )
        if len(params) != len(prompts):
            raise InvalidRequestError("sampling_params list must have one entry per prompt")
        options = dict(
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len,
            token_ids_logprob=token_ids_logprob,
            return_text_in_logprobs=return_text_in_logprobs,
        )
        groups = [self.make_requests(ids, p, **options) for ids, p in zip(prompts, params)]
        self.limits.check_logprob_entries(list(itertools.chain.from_iterable(groups)))
        for req in itertools.chain.from_iterable(groups):
            self.add_request(req)
        while self.has_work():
            self.step()
        results = [[self.result(r) for r in group] for group in groups]
        results = [r[0] if len(r) == 1 else r for r in results]
        return results if batched else results[0]

    # results ------------------------------------------------------------------------------
    def request_result(self, req: Req) -> RequestResult:
        """The typed snapshot of `req` (finished or not). Call on the engine's thread."""
        width = self.spec_config.num_draft_tokens if self.spec_config else None
        return request_result(req, width, with_text=self.tokenizer is not None)

    def result(self, req: Req) -> dict:
        """SGLang's `/generate` shape of `req`: text, output_ids, meta_info."""
        return render_generate(self.request_result(req), self.token_texts)

    def stats(self) -> EngineStats:
        """Load and speculative counters right now. Call on the engine's thread; other
        threads read `AsyncEngine.stats`, the snapshot it publishes after every step."""
        speculation = self.worker.speculation
        return engine_stats(
            self.scheduler,
            self.slot_table,
            None if speculation is None else speculation.stats,
            self.num_finished_reqs,
            self.prefix_cache.stats(),
            None if speculation is None else speculation.policy,
        )
