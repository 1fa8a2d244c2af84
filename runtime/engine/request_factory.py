# SPDX-License-Identifier: Apache-2.0
"""`RequestFactory`: turning what a client sent into validated `Req`s, off the loop thread.

The HTTP routes run it in the thread pool (`ServerState.requests`), `Engine.generate` on
the caller's thread; it never touches the scheduler, the runners or the caches. Every
check a value could fail inside a step is made here (`request_limits`): tokenizing (with
the text bound), prompt ids, lengths against the context and the KV cache, stops,
logprob options, grammars (compiled here, cached per schema by the shared, locked
`GrammarBackend`), and the `n` fan-out (`fanout`). What it reads is fixed when the engine
is built: the tokenizer, the model's configuration, the limits, and `tokens_to_admit`
(the scheduler's reservation for a request alone, a pure function of the request). Its
only mutable state is thread-safe: the lazily built grammar backend (under a lock) and
the request-id counter. Built requests are handed to the loop thread (`Engine.add_request`,
`AsyncEngine.submit`), which owns them from then on.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import uuid
from collections.abc import Callable

from runtime.configs.model_config import ModelConfig
from runtime.core.errors import InvalidRequestError
from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams
from runtime.core.stop_strings import StopStrings
from runtime.engine.fanout import fan_out
from runtime.engine.request_limits import RequestLimits
from runtime.scheduler.detokenizer import IncrementalDetokenizer


class RequestFactory:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer,
        limits: RequestLimits,
        eos_ids: set[int],
        tokens_to_admit: Callable[[Req], int],
        capacity_tokens: int,
        json_any_whitespace: bool = True,
    ):
        """`tokens_to_admit(req)`: token slots the scheduler reserves to admit `req` alone;
        `capacity_tokens`: what the KV cache holds."""
        self.model_config, self.tokenizer, self.limits = model_config, tokenizer, limits
        self.context_length = model_config.context_length
        self.eos_ids = eos_ids  # the engine's set, shared with its worker and scheduler
        self.tokens_to_admit, self.capacity_tokens = tokens_to_admit, capacity_tokens
        self.json_any_whitespace = json_any_whitespace
        self._ids = itertools.count()
        self._grammar_backend = None
        self._grammar_lock = threading.Lock()

    @property
    def bos_token_id(self) -> int:
        return getattr(self.model_config.hf_config, "bos_token_id", None) or 0

    def tokenize(
        self, prompt: str, param: str = "text", add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of `prompt`; a 400 naming `param` for text no prompt can be made of
        (lone surrogates, longer than the context could hold)."""
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
                        any_whitespace=self.json_any_whitespace,
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
            rid or self.new_rid(),
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
        need = self.tokens_to_admit(req)
        capacity = self.capacity_tokens
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
        rid = rid or self.new_rid()
        parent = rid if params.n > 1 else None
        reqs = [
            self.make_request(
                input_ids, choice, rid=choice_rid, parent_rid=parent, **request_options
            )
            for choice_rid, choice in fan_out(params, rid)
        ]
        self.limits.check_logprob_entries(reqs)  # every choice's logprobs in one response
        return reqs

    def new_rid(self) -> str:
        return f"{uuid.uuid4().hex[:12]}-{next(self._ids)}"
