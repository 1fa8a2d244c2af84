# SPDX-License-Identifier: Apache-2.0
"""OpenAI `/v1/completions` and `/v1/chat/completions` request bodies and the engine
requests they become.

The fields are the OpenAI API reference's plus SGLang's extras (SGLang's
`entrypoints/openai/protocol.py`). Every field has a declared fate: implemented, a hint that
cannot change the result (`user`, routing ids), or unsupported. An unsupported field is
accepted at its default value (null, false, empty: what routers and SDKs send filled in) and
refused with a 400 naming it otherwise; a field in neither list is refused too. Nothing a
client sends is ignored silently.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from runtime.core.errors import InvalidRequestError
from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams
from runtime.engine.request_factory import RequestFactory
from runtime.server.chat_template import ChatTemplateError, render_chat
from runtime.server.generate_fields import is_unset
from runtime.server.native_api import prompt_rids

logger = logging.getLogger(__name__)

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object, as SGLang sends it
# The OpenAI API's bounds: completions `logprobs` <= 5, chat `top_logprobs` <= 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # usage on every chunk (not implemented)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_text(self) -> str | None:
        """The JSON schema the output must match (None for free text)."""
        if self.type == "json_object":
            return JSON_OBJECT_SCHEMA
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise InvalidRequestError(
                    "response_format.json_schema.schema is required for type json_schema",
                    param="response_format",
                )
            return json.dumps(self.json_schema.schema_)
        return None


# Unsupported fields of both routes: accepted only unset (`generate_fields.is_unset`).
_COMMON_UNSUPPORTED = (
    "logit_bias",
    "stop_regex",
    "lora_path",
    "session_params",
    "custom_params",
    "custom_logit_processor",
    "watermark",
    "images_config",
    "mm_processor_kwargs",
    "return_hidden_states",
    "return_routed_experts",
    "routed_experts_start_len",
    "return_cached_tokens_details",
    "return_spec_tokens_details",
    "return_token_ids",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "disagg_prefill_dp_rank",
)


class _RequestFields(BaseModel):
    """Sampling fields both routes share, and the bookkeeping of the rest."""

    model_config = ConfigDict(extra="forbid")
    unsupported: ClassVar[tuple[str, ...]] = _COMMON_UNSUPPORTED

    model: str | None = None  # any name is served (logged), as SGLang does
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    response_format: ResponseFormat | None = None
    # SGLang / vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # SGLang's request id (one per prompt): checked by `native_api.prompt_rids` as
    # /generate checks it, so a wrong type is a 400 naming `rid`
    rid: Any = None
    # hints: they cannot change a result
    user: str | None = None
    session_id: str | None = None
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    priority: int | None = None
    custom_labels: dict[str, str] | None = None
    data_parallel_rank: int | None = None
    routed_dp_rank: int | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # unsupported (see `unsupported`)
    logit_bias: dict[str, float] | None = None
    stop_regex: str | list[str] | None = None
    lora_path: Any = None
    session_params: Any = None
    custom_params: Any = None
    custom_logit_processor: Any = None
    watermark: Any = None
    images_config: Any = None
    mm_processor_kwargs: Any = None
    return_hidden_states: Any = False
    return_routed_experts: Any = False
    routed_experts_start_len: Any = 0
    return_cached_tokens_details: Any = False
    return_spec_tokens_details: Any = False
    return_token_ids: Any = False
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    disagg_prefill_dp_rank: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def refuse_unsupported(self) -> None:
        """400 naming the first unsupported field that is set."""
        for name in self.unsupported:
            if not is_unset(getattr(self, name)):
                raise InvalidRequestError(
                    f"'{name}' is not supported by this server (leave it unset)", param=name
                )
        if self.stream_options and self.stream_options.continuous_usage_stats:
            raise InvalidRequestError(
                "'stream_options.continuous_usage_stats' is not supported by this server",
                param="stream_options",
            )

    def grammar(self) -> dict:
        """The structured-output sampling parameter: `response_format` or SGLang's
        `regex` / `json_schema` / `ebnf` extras (at most one)."""
        chosen = {k: v for k in ("regex", "json_schema", "ebnf") if (v := getattr(self, k))}
        schema = self.response_format.schema_text() if self.response_format else None
        if schema is not None:
            chosen["json_schema"] = schema
        if len(chosen) > 1 or (schema is not None and self.json_schema):
            raise InvalidRequestError(
                "set at most one of response_format, regex, json_schema and ebnf",
                param="response_format",
            )
        return chosen

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """All `n` choices' parameters; the fan-out gives choice k the seed `seed + k`.
        `max_tokens` None: whatever the context leaves."""

        def value(field_value, default):
            return default if field_value is None else field_value

        params = SamplingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=self.min_tokens,
            temperature=value(self.temperature, 1.0),
            top_p=value(self.top_p, 1.0),
            top_k=value(self.top_k, -1),
            min_p=value(self.min_p, 0.0),
            frequency_penalty=value(self.frequency_penalty, 0.0),
            presence_penalty=value(self.presence_penalty, 0.0),
            repetition_penalty=value(self.repetition_penalty, 1.0),
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim,
            n=self.n,
            sampling_seed=self.seed,
            **self.grammar(),
        )
        with openai_names():
            params.normalize()
        return params


class CompletionRequest(_RequestFields):
    unsupported: ClassVar[tuple[str, ...]] = (*_COMMON_UNSUPPORTED, "suffix", "best_of")

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        if self.best_of == 1:  # one candidate per choice is what this server does
            self.best_of = None
        super().refuse_unsupported()


# The roles of the OpenAI chat API ("developer" is the newer name of "system").
ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: ChatRole
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_RequestFields):
    unsupported: ClassVar[tuple[str, ...]] = (
        *_COMMON_UNSUPPORTED,
        "tools",
        "functions",
        "function_call",
        "audio",
        "prediction",
        "web_search_options",
        "reasoning_effort",
        "thinking",
        "task",
        "verbosity",
        "continue_final_message",
        "max_dynamic_patch",
        "min_dynamic_patch",
        "use_audio_in_video",
        "video_config",
        "input_ids",
        "return_prompt_token_ids",
        "return_meta_info",
        "return_input_ids_in_sglext",
        "return_output_ids_in_sglext",
        "return_sampling_mask",
        "sampling_logprobs_mode",
        "return_flat_raw_output_top_logprobs",
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: list[str] | None = None
    # tool calling: this server's models have no tool-call format (see `refuse_unsupported`)
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[dict] | None = None
    function_call: Any = None
    # hints: only meaningful with a reasoning parser or the flat top-logprob layout
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    return_flat_raw_top_logprobs_b64: bool | None = None
    # unsupported
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    thinking: Any = None
    task: Any = None
    verbosity: Any = None
    continue_final_message: Any = False
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    use_audio_in_video: Any = False
    video_config: Any = None
    input_ids: Any = None
    return_prompt_token_ids: Any = False
    return_meta_info: Any = False
    return_input_ids_in_sglext: Any = False
    return_output_ids_in_sglext: Any = False
    return_sampling_mask: Any = False
    sampling_logprobs_mode: Any = None
    return_flat_raw_output_top_logprobs: Any = False

    def refuse_unsupported(self) -> None:
        if self.tools:
            raise InvalidRequestError(
                "'tools' is not supported by this server: the served model's chat template "
                "has no tool-call format, so tool calls could not be parsed",
                param="tools",
            )
        if self.tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError(
                f"'tool_choice' {self.tool_choice!r} needs tools, which this server does not "
                "support (send 'none' or 'auto' or leave it unset)",
                param="tool_choice",
            )
        if self.modalities not in (None, [], ["text"]):
            raise InvalidRequestError(
                "'modalities' other than ['text'] are not supported", param="modalities"
            )
        super().refuse_unsupported()


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
        if not isinstance(error, InvalidRequestError) or isinstance(error, ChatTemplateError):
            return False
        message = _OPENAI_NAME_PATTERN.sub(lambda m: self.names[m.group(1)], str(error))
        param = self.names.get(error.param, error.param)
        raise type(error)(message, param=param) from None


T = TypeVar("T")


def with_openai_names(build: Callable[..., T], *args, **renamed: str) -> T:
    with openai_names(**renamed):
        return build(*args)


def log_model_name(requested: str | None, served: str) -> None:
    """Any `model` is served (SGLang's behaviour: one model per server); an unexpected
    name is logged so a misrouted client shows up in the log."""
    if requested is not None and requested != served:
        logger.info("request names model %r; serving %r", requested, served)


def _max_tokens(requested: int | None, prompt_len: int, engine: RequestFactory) -> int | None:
    """The client's limit, or (when it sets none) None: whatever the context leaves."""
    if requested is None:
        return None
    if requested < 0:
        raise InvalidRequestError(f"max_tokens must be >= 0, got {requested}", param="max_tokens")
    return requested


# --------------------------------------------------------------------------------------
# /v1/completions


def completion_prompts(body: CompletionRequest, engine: RequestFactory) -> list[list[int]]:
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


def echo_texts(
    body: CompletionRequest, prompts: list[list[int]], engine: RequestFactory
) -> list[str]:
    """What `echo` puts before each prompt's choices: the prompt as sent, or for token ids
    their text without special tokens (SGLang's `_prepare_echo_prompts`), so a tokenizer
    that prepends BOS does not show it."""
    if isinstance(body.prompt, str):
        return [body.prompt]
    if body.prompt and isinstance(body.prompt[0], str):
        return list(body.prompt)
    if engine.tokenizer is None:
        return [""] * len(prompts)
    return [engine.tokenizer.decode(ids, skip_special_tokens=True) for ids in prompts]


def completion_requests(body: CompletionRequest, engine: RequestFactory) -> list[Req]:
    """One request per (prompt, choice), in OpenAI's choice order (prompt-major). With
    `echo` and `logprobs` the prompt's tokens are scored too, in the prefill the request
    runs anyway (`logprob_start_len = 0`)."""
    body.refuse_unsupported()
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise InvalidRequestError(
            f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}] (the OpenAI API's bound), "
            f"got {body.logprobs}",
            param="logprobs",
        )
    reqs = []
    prompts = completion_prompts(body, engine)
    for ids, rid in zip(prompts, prompt_rids(body.rid, len(prompts))):
        params = body.sampling_params(_max_tokens(body.max_tokens, len(ids), engine))
        reqs += engine.make_requests(
            ids,
            params,
            rid=rid,
            return_logprob=body.logprobs is not None,
            top_logprobs_num=body.logprobs or 0,
            logprob_start_len=0 if body.echo and body.logprobs is not None else -1,
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


def chat_prompt_ids(body: ChatCompletionRequest, engine: RequestFactory) -> list[int]:
    """The messages through the tokenizer's chat template with the client's checked
    `chat_template_kwargs` (`chat_template.render_chat`), ending with the assistant's turn."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidRequestError(
            "this server has no tokenizer, so it cannot apply a chat template"
        )
    messages = [
        {**m.model_dump(exclude_none=True), "content": _message_text(m, i)}
        for i, m in enumerate(body.messages)
    ]
    for message in messages:  # the templated text is checked again before tokenizing
        engine.limits.check_text(message["content"], "messages")
    text = render_chat(tokenizer, messages, body.chat_template_kwargs)
    return engine.tokenize(text, "messages", add_special_tokens=False)


def chat_requests(body: ChatCompletionRequest, engine: RequestFactory) -> list[Req]:
    body.refuse_unsupported()
    if not 0 <= (body.top_logprobs or 0) <= MAX_CHAT_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}] (the OpenAI API's bound), "
            f"got {body.top_logprobs}",
            param="top_logprobs",
        )
    ids = chat_prompt_ids(body, engine)
    requested = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    params = body.sampling_params(_max_tokens(requested, len(ids), engine))
    return engine.make_requests(
        ids,
        params,
        rid=prompt_rids(body.rid, 1)[0],
        return_logprob=bool(body.logprobs),
        top_logprobs_num=top,
    )
