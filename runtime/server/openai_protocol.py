# SPDX-License-Identifier: Apache-2.0
"""OpenAI `/v1/completions` and `/v1/chat/completions` request bodies (the OpenAI API
reference's fields, plus SGLang's/vLLM's extra sampling fields) and the engine requests
they become."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal, TypeVar

import jinja2
from pydantic import BaseModel, ConfigDict, Field

from runtime.core.errors import InvalidRequestError
from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams
from runtime.engine.engine import Engine


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # SGLang / vLLM extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """All `n` choices' parameters; the fan-out gives choice k the seed `seed + k`."""
        params = SamplingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            n=self.n,
            sampling_seed=self.seed,
        )
        with openai_names():
            params.normalize()
        return params


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


# The roles of the OpenAI chat API ("developer" is the newer name of "system").
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: ChatRole
    content: str | list[dict] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# SGLang's names of the fields the OpenAI API names differently, for error messages.
_OPENAI_NAMES = {
    "sampling_seed": "seed",
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "input_ids": "prompt",
    "text": "prompt",
    "top_logprobs_num": "logprobs",
}
_OPENAI_NAME_PATTERN = re.compile(r"\b(" + "|".join(_OPENAI_NAMES) + r")\b")


class openai_names:  # noqa: N801 - used as a context manager, like contextlib's helpers
    """Re-raise an `InvalidRequestError` with the OpenAI API's field names."""

    def __init__(self, **renamed: str):
        self.names = {**_OPENAI_NAMES, **renamed}

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if not isinstance(error, InvalidRequestError):
            return False
        message = _OPENAI_NAME_PATTERN.sub(lambda m: self.names[m.group(1)], str(error))
        param = self.names.get(error.param, error.param)
        raise type(error)(message, param=param) from None


T = TypeVar("T")


def with_openai_names(build: Callable[..., T], *args, **renamed: str) -> T:
    with openai_names(**renamed):
        return build(*args)


def check_model(requested: str | None, served: set[str]) -> None:
    if requested is not None and requested not in served:
        raise InvalidRequestError(
            f"model '{requested}' is not served here; available: {sorted(served)}"
        )


def _max_tokens(requested: int | None, prompt_len: int, engine: Engine) -> int:
    """The client's limit, or (when it sets none) whatever the context leaves."""
    if requested is None:
        return max(0, engine.context_length - prompt_len)
    if requested < 0:
        raise InvalidRequestError(f"max_tokens must be >= 0, got {requested}")
    return requested


# --------------------------------------------------------------------------------------
# /v1/completions


def completion_prompts(body: CompletionRequest, engine: Engine) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [engine.tokenize(prompt, "prompt")]
    if not prompt:
        raise InvalidRequestError("empty prompt: send at least one token", param="prompt")
    if isinstance(prompt[0], str):
        return [engine.tokenize(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def completion_requests(body: CompletionRequest, engine: Engine) -> list[Req]:
    """One request per (prompt, choice), in OpenAI's choice order (prompt-major)."""
    reqs = []
    for ids in completion_prompts(body, engine):
        params = body.sampling_params(_max_tokens(body.max_tokens, len(ids), engine))
        reqs += engine.make_requests(
            ids,
            params,
            return_logprob=body.logprobs is not None,
            top_logprobs_num=body.logprobs or 0,
        )
    return reqs


# --------------------------------------------------------------------------------------
# /v1/chat/completions


def _message_text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for j, part in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if part.get("type") != "text":
            raise InvalidRequestError(
                f"message content of type '{part.get('type')}' is not supported", param=where
            )
        text = part.get("text", "")
        if not isinstance(text, str):
            raise InvalidRequestError(f"'{where}.text' must be a string", param=f"{where}.text")
        parts.append(text)
    return "".join(parts)


def chat_prompt_ids(body: ChatCompletionRequest, engine: Engine) -> list[int]:
    """The messages through the tokenizer's chat template (transformers'
    `apply_chat_template`), ending with the assistant's turn."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidRequestError(
            "this server has no tokenizer, so it cannot apply a chat template"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model's tokenizer has no chat template; use /v1/completions"
        )
    messages = [
        {"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(body.messages)
    ]
    for message in messages:  # the templated text is checked again before tokenizing
        engine.limits.check_text(message["content"], "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except jinja2.TemplateError as err:  # the template refuses these messages
        raise InvalidRequestError(
            f"the chat template refused the messages: {err}", param="messages"
        ) from None
    return engine.tokenize(text, "messages", add_special_tokens=False)


def chat_requests(body: ChatCompletionRequest, engine: Engine) -> list[Req]:
    ids = chat_prompt_ids(body, engine)
    requested = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true")
    params = body.sampling_params(_max_tokens(requested, len(ids), engine))
    return engine.make_requests(ids, params, return_logprob=body.logprobs, top_logprobs_num=top)
