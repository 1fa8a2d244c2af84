# SPDX-License-Identifier: Apache-2.0
"""`EngineCore`: the engine's mutable state and the one thread that may touch it.

Building it loads the checkpoint, the worker (target and MTP draft runners, their cache
pools), the scheduler and the prefix cache, and, for a multi-rank replica, starts the
other ranks. After that every method below is for the loop thread alone (the caller's
thread for `Engine.generate`, the `engine-loop` thread under `AsyncEngine`): `add_request`,
`step`, `abort`/`abort_all`, `flush_cache`, `run_to_completion`, `stats`,
`request_result`, `shutdown`. Nothing here locks; a second thread must go through the
`AsyncEngine` inbox. What other threads may use is `requests` (the `RequestFactory`:
tokenizing, validation, grammars, fan-out) and the fixed description `info`; neither
reads the scheduler's or the caches' changing state. `Engine` (`engine.py`) is the public
entry point on top: `generate` and SGLang's dicts.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from runtime.cache.prefix_cache import PrefixCache, RadixPrefixCache
from runtime.configs.capture import CaptureConfig
from runtime.configs.compiler_caches import point_compiler_caches
from runtime.configs.engine_config import EngineConfig
from runtime.core.request import FinishReason, Req
from runtime.core.result import RequestResult
from runtime.core.stats import EngineInfo, EngineStats
from runtime.engine.capture_warmup import compile_at_startup
from runtime.engine.host_malloc import keep_freed_memory
from runtime.engine.ranks import RankMemory, ReplicaLeader, memory_report
from runtime.engine.request_factory import RequestFactory
from runtime.engine.request_limits import RequestLimits, longest_token_chars
from runtime.engine.results import engine_stats, request_result
from runtime.engine.setup import engine_setup, with_resolved_dtype
from runtime.engine.tokenizer import load_tokenizer
from runtime.engine.worker_factory import build_worker
from runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineCore:
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
        limits = RequestLimits(
            vocab_size=self.model_config.vocab_size,
            context_length=self.context_length,
            max_n=config.max_n,
            max_top_logprobs=config.max_top_logprobs,
            max_logprob_entries=config.max_logprob_entries,
            max_text_chars=None
            if self.tokenizer is None
            else self.context_length * longest_token_chars(self.tokenizer),
        )
        self.requests = RequestFactory(
            self.model_config,
            self.tokenizer,
            limits,
            self.eos_ids,
            self.scheduler.tokens_to_admit,
            self.slot_table.allocator.capacity_tokens,
            json_any_whitespace=not config.constrained_json_disable_any_whitespace,
        )
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

    # the loop thread --------------------------------------------------------------------
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

    def run_to_completion(self, reqs: list[Req]) -> None:
        """Add `reqs` and step until nothing is left to do (the blocking path of
        `Engine.generate`, the start-up warm-up and the speculation calibration)."""
        for req in reqs:
            self.add_request(req)
        while self.has_work():
            self.step()

    # results ------------------------------------------------------------------------------
    def request_result(self, req: Req) -> RequestResult:
        """The typed snapshot of `req` (finished or not). Call on the engine's thread."""
        width = self.spec_config.num_draft_tokens if self.spec_config else None
        return request_result(req, width, with_text=self.tokenizer is not None)

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
