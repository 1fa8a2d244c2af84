# SPDX-License-Identifier: Apache-2.0
"""SGLang's `/generate` JSON for a `RequestResult`: `text`, `output_ids`, `meta_info`.

The layout is SGLang's (`tokenizer_manager.py`: `meta_info` with `finish_reason`, token
counts, `[logprob, token_id, text]` triples, and the `spec_*` counters of EAGLE/NEXTN).
`Engine.generate` returns it, as `sglang.Engine.generate` does, and the native HTTP route
sends it; both call this one renderer (with the engine's `token_texts` for
`return_text_in_logprobs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from runtime.core.result import Logprobs, RequestResult, SpecCounters

# token ids -> the text of each token alone (SGLang decodes `[[id] for id in ids]`)
TokenTexts = Callable[[Sequence[int]], list[str]]


def render_generate(result: RequestResult, token_texts: TokenTexts | None = None) -> dict:
    """`token_texts` fills the text slot of each logprob entry when the request asked for
    it (`return_text_in_logprobs`); without it (no tokenizer) the slot stays None."""
    meta = {
        "id": result.rid,
        "finish_reason": result.finish_reason.to_json() if result.finish_reason else None,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
        "e2e_latency": result.timing.e2e_latency,
    }
    if result.spec is not None:
        meta.update(_spec_meta(result.spec))
    if result.logprobs is not None:
        texts = token_texts if result.logprobs.with_text else None
        meta.update(_logprob_meta(result.logprobs, texts))
    return {"text": result.text, "output_ids": list(result.output_ids), "meta_info": meta}


def _spec_meta(spec: SpecCounters) -> dict:
    """SGLang's three counters, `spec_accept_length` left out before the first round (as
    SGLang does), and the tokens decoded while speculation was paused."""
    meta = {"spec_verify_ct": spec.verify_rounds}
    if spec.accept_length is not None:
        meta["spec_accept_length"] = spec.accept_length
    meta["spec_accept_histogram"] = list(spec.accept_histogram)
    meta["spec_plain_decode_tokens"] = spec.plain_decode_tokens
    return meta


def _logprob_meta(logprobs: Logprobs, token_texts: TokenTexts | None) -> dict:
    """`[logprob, token_id, text]` triples (text None unless asked), SGLang's layout."""

    def triples(entries) -> list[list]:
        texts = token_texts([t for _, t in entries]) if token_texts and entries else None
        return [[lp, t, texts[i] if texts else None] for i, (lp, t) in enumerate(entries)]

    def lists(rows) -> list:
        return [None if row is None else triples(row) for row in rows]

    meta = {
        "input_token_logprobs": triples(logprobs.input_token_logprobs),
        "output_token_logprobs": triples(logprobs.output_token_logprobs),
        "input_top_logprobs": lists(logprobs.input_top_logprobs),
        "output_top_logprobs": lists(logprobs.output_top_logprobs),
    }
    if logprobs.token_ids_logprob is not None:
        meta["input_token_ids_logprobs"] = lists(logprobs.input_token_ids_logprobs)
        meta["output_token_ids_logprobs"] = lists(logprobs.output_token_ids_logprobs)
    return meta
