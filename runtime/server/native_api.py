# SPDX-License-Identifier: Apache-2.0
"""SGLang's native `POST /generate`: request parsing and response shaping."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.core.errors import InvalidRequestError
from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams
from runtime.engine.engine import Engine

# Accepted for compatibility but unused by this runtime; a non-null value is refused.
_UNSUPPORTED = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "lora_path",
    "session_params",
    "custom_logit_processor",
    "return_hidden_states",
    "token_ids_logprob",
)
_KNOWN = {
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    *_UNSUPPORTED,
}


def _expect(value, types, name: str):
    """`value` unchanged when None or of `types` (a bool is not an int here), else a 400."""
    types = types if isinstance(types, tuple) else (types,)
    if value is None:
        return None
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        kinds = " or ".join(t.__name__ for t in types)
        raise InvalidRequestError(f"'{name}' must be {kinds}, got {type(value).__name__}")
    return value


@dataclass
class GenerateCall:
    groups: list[list[Req]]  # one group per prompt (n requests each)
    batched: bool
    stream: bool


def parse_generate(body, engine: Engine) -> GenerateCall:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    for name in _UNSUPPORTED:
        if body.get(name) is not None:
            raise InvalidRequestError(f"'{name}' is not supported by this server")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise InvalidRequestError("send exactly one of 'text' or 'input_ids'")
    if text is not None:
        _expect(text, (str, list), "text")
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if any(not isinstance(t, str) for t in texts):
            raise InvalidRequestError("'text' must be a string or a list of strings")
        prompts = [engine.tokenize(t) if t else [] for t in texts]
    else:
        _expect(input_ids, list, "input_ids")
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
    if batched and not prompts:
        raise InvalidRequestError("empty batch: send at least one prompt")
    params = body.get("sampling_params")
    if isinstance(params, list):
        if len(params) != len(prompts):
            raise InvalidRequestError("'sampling_params' list must have one entry per prompt")
    else:
        _expect(params, dict, "sampling_params")
        params = [params] * len(prompts)
    stream = bool(_expect(body.get("stream", False), bool, "stream"))
    return_logprob = bool(_expect(body.get("return_logprob", False), bool, "return_logprob"))
    top_n = _expect(body.get("top_logprobs_num", 0), int, "top_logprobs_num") or 0
    start = _expect(body.get("logprob_start_len", -1), int, "logprob_start_len")
    rids = body.get("rid")
    rids = rids if isinstance(rids, list) else [rids] * len(prompts)
    groups = []
    for i, (ids, p) in enumerate(zip(prompts, params)):
        parsed = SamplingParams.from_dict(p)
        group = []
        for k in range(parsed.n):
            rid = rids[i] if rids[i] is None or parsed.n == 1 else f"{rids[i]}-{k}"
            group.append(
                engine.make_request(
                    ids,
                    parsed,
                    rid=rid,
                    return_logprob=return_logprob,
                    top_logprobs_num=top_n,
                    logprob_start_len=-1 if start is None else start,
                )
            )
        groups.append(group)
    return GenerateCall(groups, batched, stream)


def response_shape(call: GenerateCall, results: list[list[dict]]):
    """One object for one prompt and n = 1, else lists (SGLang's layout)."""
    flat = [r for group in results for r in group]
    if not call.batched and len(flat) == 1:
        return flat[0]
    return flat
