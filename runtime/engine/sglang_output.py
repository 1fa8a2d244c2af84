# SPDX-License-Identifier: Apache-2.0
"""SGLang's `/generate` JSON for a `RequestResult`: `text`, `output_ids`, `meta_info`.

The layout is SGLang's (`tokenizer_manager.py`: `meta_info` with `finish_reason`, token
counts, `[logprob, token_id, text]` triples, and the `spec_*` counters of EAGLE/NEXTN).
`Engine.generate` returns it, as `sglang.Engine.generate` does, and the native HTTP route
sends it; both call this one renderer.
"""

from __future__ import annotations

from runtime.core.result import Logprobs, RequestResult, SpecCounters


def render_generate(result: RequestResult) -> dict:
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
        meta.update(_logprob_meta(result.logprobs))
    return {"text": result.text, "output_ids": list(result.output_ids), "meta_info": meta}


def _spec_meta(spec: SpecCounters) -> dict:
    return {
        "spec_verify_ct": spec.verify_rounds,
        "spec_accept_length": spec.accept_length,
        "spec_accept_histogram": list(spec.accept_histogram),
    }


def _logprob_meta(logprobs: Logprobs) -> dict:
    def triple(logprob, token_id):
        return [logprob, token_id, None]  # no text: SGLang's return_text_in_logprobs=False

    return {
        "input_token_logprobs": [triple(lp, t) for lp, t in logprobs.input_token_logprobs],
        "output_token_logprobs": [triple(lp, t) for lp, t in logprobs.output_token_logprobs],
        "input_top_logprobs": [None] * len(logprobs.input_token_logprobs)
        if logprobs.top_logprobs_num
        else [],
        "output_top_logprobs": [
            [triple(lp, t) for lp, t in top] for top in logprobs.output_top_logprobs
        ],
    }
