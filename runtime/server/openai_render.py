# SPDX-License-Identifier: Apache-2.0
"""OpenAI response objects from typed `RequestResult`s: `text_completion`,
`chat.completion` and their stream chunks' choices, logprobs and usage, as in the OpenAI
API reference (plus SGLang's `matched_stop`)."""

from __future__ import annotations

import time
import uuid

from runtime.core.result import RequestResult


def error_body(message: str, status: int, kind: str = "invalid_request_error", param=None) -> dict:
    return {
        "object": "error",
        "error": {"message": message, "type": kind, "param": param, "code": status},
    }


def finish_reason(result: RequestResult) -> tuple[str | None, object]:
    """(OpenAI finish_reason, SGLang's matched_stop); (None, None) while running."""
    reason = result.finish_reason
    if reason is None:
        return None, None
    if reason.type == "abort":
        return "abort", None
    return reason.type, reason.matched if reason.type == "stop" else None


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _new_logprobs(result: RequestResult, start: int):
    """(token logprobs, top lists) of the output tokens from `start` on."""
    if result.logprobs is None:
        return (), ()
    return (
        result.logprobs.output_token_logprobs[start:],
        result.logprobs.output_top_logprobs[start:],
    )


def completion_logprobs(
    result: RequestResult, tokenizer, start: int = 0, with_prompt: bool = False
) -> dict:
    """OpenAI's completion `logprobs`: the output tokens from `start` on, preceded, with
    `with_prompt` (echo), by the prompt's tokens (the first one's logprob null, as in the
    OpenAI API and SGLang). `top_logprobs` has one entry per token (null for the first
    prompt token) when the request asked for top logprobs, else it is null."""
    entries, tops = _new_logprobs(result, start)
    wants_top = result.logprobs is not None and result.logprobs.top_logprobs_num > 0
    if with_prompt and result.logprobs is not None:
        prompt = result.logprobs.input_token_logprobs
        entries = tuple(prompt) + tuple(entries)
        prompt_tops = result.logprobs.input_top_logprobs or (None,) * len(prompt)
        tops = tuple(prompt_tops) + tuple(tops)
    ids = [t for _, t in entries]
    tokens = [token_text(tokenizer, t) for t in ids]
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    offsets, pos = [], 0
    for tid, tok in zip(ids, tokens):
        offsets.append(pos)
        pos += 0 if tid in special else len(tok)  # special tokens are not in the text
    top_maps = None
    if wants_top:
        top_maps = [
            None if top is None else {token_text(tokenizer, t): lp for lp, t in top} for top in tops
        ]
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in entries],
        "top_logprobs": top_maps,
        "text_offset": offsets,
    }


def chat_logprobs(result: RequestResult, tokenizer, start: int = 0) -> dict:
    entries, tops = _new_logprobs(result, start)
    tops = tops or [()] * len(entries)

    def item(lp, tid):
        text = token_text(tokenizer, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {
        "content": [
            {**item(lp, t), "top_logprobs": [item(l2, t2) for l2, t2 in top]}
            for (lp, t), top in zip(entries, tops)
        ]
    }


def usage(results: list[RequestResult], n: int) -> dict:
    """Token counts; each prompt counts once however many choices (`n`) it has, its prompt
    and cached tokens those of its first choice (as SGLang's OpenAI serving sums them)."""
    prompt = sum(r.prompt_tokens for r in results[::n])
    completion = sum(r.completion_tokens for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in results[::n])},
    }


def completion_choice(index, text, reason, matched, logprobs) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": reason,
        "matched_stop": matched,
    }


def chat_delta_choice(index, text, reason, matched, logprobs) -> dict:
    del matched  # chat chunks carry no matched_stop
    return {
        "index": index,
        "delta": {"content": text} if text else {},
        "logprobs": logprobs,
        "finish_reason": reason,
    }


def chat_opening_choice(index: int) -> dict:
    """The first chunk of each chat choice: the assistant's role, no text yet."""
    return {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


def response_id(rid, prefix: str) -> str:
    """The response's `id`: the client's request id where it sent one (SGLang answers with
    the first request's id; a batch's first prompt's here), else `<prefix>-<uuid>`."""
    if isinstance(rid, list) and rid and isinstance(rid[0], str):
        return rid[0]
    return rid if isinstance(rid, str) else f"{prefix}-{uuid.uuid4().hex}"


def completion_response(
    results: list[RequestResult],
    n: int,
    model: str,
    tokenizer,
    echo_texts,
    logprobs: bool,
    rid=None,
) -> dict:
    """`echo_texts`: one prompt text per prompt to put before its choices' text (and the
    prompt's tokens before their logprobs), or None; `rid`: the client's request id."""
    choices = []
    for i, r in enumerate(results):
        text = (echo_texts[i // n] if echo_texts else "") + (r.text or "")
        lp = completion_logprobs(r, tokenizer, with_prompt=bool(echo_texts)) if logprobs else None
        choices.append(completion_choice(i, text, *finish_reason(r), lp))
    return {
        "id": response_id(rid, "cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(results, n),
    }


def chat_response(
    results: list[RequestResult], n: int, model: str, tokenizer, logprobs: bool, rid=None
) -> dict:
    choices = []
    for i, r in enumerate(results):
        reason, matched = finish_reason(r)
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": r.text or ""},
                "finish_reason": reason,
                "matched_stop": matched,
                "logprobs": chat_logprobs(r, tokenizer) if logprobs else None,
            }
        )
    return {
        "id": response_id(rid, "chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(results, n),
    }
