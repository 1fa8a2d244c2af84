# SPDX-License-Identifier: Apache-2.0
"""`Engine`: load a checkpoint and generate, in process (`from runtime import Engine`).

    engine = Engine(model_path="/ckpt", dtype="float32")   # or Engine(EngineConfig(...))
    out = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 16})
    out["text"], out["output_ids"], out["meta_info"]

The public entry point over two parts with their own thread contracts: the `EngineCore`
it is (`engine_core.py`: scheduler, runners, caches; loop thread only) and its
`RequestFactory` (`engine.requests`, `request_factory.py`: tokenizing, validation,
grammars, fan-out; any thread). `generate` is the blocking convenience on top, shaped
like nano-vllm's `LLMEngine.generate` and returning `sglang.Engine.generate`'s dicts
(`result` renders a request's typed `RequestResult` as one); it runs the step loop on the
caller's thread, so it must not be mixed with an `AsyncEngine` over the same engine. The
request-building names (`make_request(s)`, `tokenize`, ...) forward to the factory.
"""

from __future__ import annotations

import itertools

from runtime.configs.engine_config import DEFAULT_MODEL_DIR, default_model_path
from runtime.core.errors import InvalidRequestError
from runtime.core.request import Req
from runtime.engine.engine_core import EngineCore
from runtime.engine.sglang_output import render_generate

__all__ = ["DEFAULT_MODEL_DIR", "Engine", "default_model_path"]


class Engine(EngineCore):
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
            prompts = [self.requests.tokenize(p, name) for p, name in zip(texts, names)]
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
        groups = [self.requests.make_requests(ids, p, **options) for ids, p in zip(prompts, params)]
        reqs = list(itertools.chain.from_iterable(groups))
        self.requests.limits.check_logprob_entries(reqs)
        self.run_to_completion(reqs)
        results = [[self.result(r) for r in group] for group in groups]
        results = [r[0] if len(r) == 1 else r for r in results]
        return results if batched else results[0]

    def result(self, req: Req) -> dict:
        """SGLang's `/generate` shape of `req`: text, output_ids, meta_info."""
        return render_generate(self.request_result(req), self.requests.token_texts)

    # request building: the factory's (safe on any thread) ------------------------------
    @property
    def limits(self):
        return self.requests.limits

    @property
    def bos_token_id(self) -> int:
        return self.requests.bos_token_id

    def tokenize(self, prompt: str, param: str = "text", add_special_tokens: bool = True):
        return self.requests.tokenize(prompt, param, add_special_tokens)

    def check_input_ids(self, ids, param: str = "input_ids") -> list[int]:
        return self.requests.check_input_ids(ids, param)

    def token_texts(self, token_ids) -> list[str]:
        return self.requests.token_texts(token_ids)

    def grammar_backend(self):
        return self.requests.grammar_backend()

    def make_request(self, *args, **kwargs) -> Req:
        """`RequestFactory.make_request`: one validated request, not queued yet."""
        return self.requests.make_request(*args, **kwargs)

    def make_requests(self, *args, **kwargs) -> list[Req]:
        """`RequestFactory.make_requests`: the `n` requests of one prompt."""
        return self.requests.make_requests(*args, **kwargs)
