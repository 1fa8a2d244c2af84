# SPDX-License-Identifier: Apache-2.0
"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions`: request models and
response shaping. SGLang's extra sampling fields are accepted in the body too."""

from __future__ import annotations

import time
import uuid

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

    def sampling_params(self, max_tokens: int, choice: int) -> SamplingParams:
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
            # each of the n choices gets its own stream of randomness from the same seed
            sampling_seed=None if self.seed is None else self.seed + choice,
        )
        params.normalize()
        return params


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def error_body(message: str, status: int, kind: str = "invalid_request_error", param=None) -> dict:
    return {
        "object": "error",
        "error": {"message": message, "type": kind, "param": param, "code": status},
    }


def check_model(requested: str | None, served: set[str]) -> None:
    if requested is not None and requested not in served:
        raise InvalidRequestError(
            f"model '{requested}' is not served here; available: {sorted(served)}"
        )


def _max_tokens(requested: int | None, prompt_len: int, engine: Engine) -> int:
    room = engine.context_length - prompt_len
    if requested is None:
        return max(0, room)
    if requested < 0:
        raise InvalidRequestError(f"max_tokens must be >= 0, got {requested}")
    return requested


# --------------------------------------------------------------------------------------
# /v1/completions


def completion_prompts(body: CompletionRequest, engine: Engine) -> list[list[int]]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [engine.tokenize(prompt)]
    if not prompt:
        raise InvalidRequestError("empty prompt: send at least one token")
    if isinstance(prompt[0], str):
        return [engine.tokenize(p) for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def completion_requests(body: CompletionRequest, engine: Engine) -> list[Req]:
    """One request per (prompt, choice), in OpenAI's choice order."""
    reqs = []
    top = body.logprobs or 0
    for ids in completion_prompts(body, engine):
        for k in range(body.n):
            params = body.sampling_params(_max_tokens(body.max_tokens, len(ids), engine), k)
            reqs.append(
                engine.make_request(
                    ids, params, return_logprob=body.logprobs is not None, top_logprobs_num=top
                )
            )
    return reqs


def finish_reason(req_result: dict) -> tuple[str | None, object]:
    reason = req_result["meta_info"]["finish_reason"]
    if reason is None:
        return None, None
    if reason["type"] == "abort":
        return "abort", None
    return reason["type"], reason.get("matched")


def completion_logprobs(result: dict, engine: Engine, start: int = 0) -> dict:
    meta = result["meta_info"]
    entries = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:]
    tokens = [engine.tokenizer.decode([t]) if engine.tokenizer else str(t) for _, t, _ in entries]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top_maps = (
        [
            {(engine.tokenizer.decode([t]) if engine.tokenizer else str(t)): lp for lp, t, _ in top}
            for top in tops
        ]
        if tops
        else None
    )
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _, _ in entries],
        "top_logprobs": top_maps,
        "text_offset": offsets,
    }


def usage(results: list[dict], prompt_tokens: int) -> dict:
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def prompt_tokens_of(results: list[dict], n: int) -> int:
    """Each prompt counts once, however many choices it has."""
    return sum(r["meta_info"]["prompt_tokens"] for r in results[::n])


def completion_response(
    body: CompletionRequest, results: list[dict], model: str, engine: Engine, echo_texts: list[str]
) -> dict:
    choices = []
    for i, r in enumerate(results):
        reason, matched = finish_reason(r)
        text = (echo_texts[i // body.n] if body.echo else "") + (r["text"] or "")
        choices.append(
            {
                "index": i,
                "text": text,
                "finish_reason": reason,
                "matched_stop": matched,
                "logprobs": completion_logprobs(r, engine) if body.logprobs is not None else None,
            }
        )
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(results, prompt_tokens_of(results, body.n)),
    }


# --------------------------------------------------------------------------------------
# /v1/chat/completions


def _message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text":
            raise InvalidRequestError(
                f"message content of type '{part.get('type')}' is not supported"
            )
        parts.append(part.get("text", ""))
    return "".join(parts)


def chat_prompt_ids(body: ChatCompletionRequest, engine: Engine) -> list[int]:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise InvalidRequestError(
            "this server has no tokenizer, so it cannot apply a chat template"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model's tokenizer has no chat template; use /v1/completions"
        )
    messages = [{"role": m.role, "content": _message_text(m)} for m in body.messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def chat_requests(body: ChatCompletionRequest, engine: Engine) -> list[Req]:
    ids = chat_prompt_ids(body, engine)
    requested = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    top = body.top_logprobs or 0
    if top and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true")
    return [
        engine.make_request(
            ids,
            body.sampling_params(_max_tokens(requested, len(ids), engine), k),
            return_logprob=body.logprobs,
            top_logprobs_num=top,
        )
        for k in range(body.n)
    ]


def chat_logprobs(result: dict, engine: Engine, start: int = 0) -> dict:
    meta = result["meta_info"]
    entries = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:] or [[]] * len(entries)

    def item(lp, tid):
        text = engine.tokenizer.decode([tid]) if engine.tokenizer else str(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {
        "content": [
            {**item(lp, t), "top_logprobs": [item(l2, t2) for l2, t2, _ in top]}
            for (lp, t, _), top in zip(entries, tops)
        ]
    }


def chat_response(
    body: ChatCompletionRequest, results: list[dict], model: str, engine: Engine
) -> dict:
    choices = []
    for i, r in enumerate(results):
        reason, matched = finish_reason(r)
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": r["text"] or ""},
                "finish_reason": reason,
                "matched_stop": matched,
                "logprobs": chat_logprobs(r, engine) if body.logprobs else None,
            }
        )
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(results, prompt_tokens_of(results, body.n)),
    }
