# SPDX-License-Identifier: Apache-2.0
"""What a request may ask for, checked before it reaches the scheduler.

Every value a client sends is checked here or in `SamplingParams.normalize`, so nothing
that passes can fail inside an engine step: token ids inside the vocabulary, valid Unicode
text (no lone surrogates), at most `max_n` choices, and a prompt the context length and the
KV pool can hold (SGLang's `max_req_input_len` rule, without auto-truncation).

What one request may cost the server is bounded too: `max_top_logprobs` alternatives per
token (vLLM's `max_logprobs`), `max_logprob_entries` logprob entries in one response
(counted before it runs, `logprob_entries`), and at most `MAX_STOP_STRINGS` stop strings
of `MAX_STOP_STRING_CHARS` characters and `MAX_STOP_TOKEN_IDS` stop token ids. Prompt text
longer than `context_length * longest_token_chars` characters is refused before it is
tokenized. The limits and why each is set so: docs/serving_limits.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from runtime.core.errors import InvalidRequestError
from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256

MAX_RID_CHARS = 256  # a request id is a key in logs and tables, not a payload


def longest_token_chars(tokenizer) -> int:
    """Characters in the longest entry of the tokenizer's vocabulary (added tokens too)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def check_unicode(text: str, param: str) -> None:
    """400 when `text` holds a lone surrogate (`\\ud800` in JSON): not encodable as UTF-8,
    so no tokenizer can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(
            f"'{param}' is not valid Unicode: a lone surrogate at character {err.start}",
            param=param,
        ) from None


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    context_length: int
    max_n: int
    max_text_chars: int | None = None  # None: no tokenizer, no text prompts
    max_top_logprobs: int = 20
    max_logprob_entries: int = 2**19

    def check_text(self, text: str, param: str = "text") -> None:
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"'{param}' must be a string (token ids go in input_ids), got "
                f"{type(text).__name__}",
                param=param,
            )
        check_unicode(text, param)
        if self.max_text_chars is not None and len(text) > self.max_text_chars:
            raise InvalidRequestError(
                f"'{param}' has {len(text)} characters: more than the context length "
                f"({self.context_length} tokens) can hold with this tokenizer "
                f"(at most {self.max_text_chars} characters); shorten the prompt",
                param=param,
            )

    def check_token_ids(self, ids: Iterable, param: str) -> None:
        vocab = self.vocab_size
        for i, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise InvalidRequestError(
                    f"'{param}' must hold token ids in [0, {vocab}); entry {i} is {token!r}",
                    param=param,
                )

    def check_prompt_ids(self, ids, param: str = "input_ids") -> list[int]:
        if not isinstance(ids, list):
            raise InvalidRequestError(
                f"'{param}' must be a list of token ids, got {type(ids).__name__}", param=param
            )
        if not ids:
            raise InvalidRequestError("empty prompt: send at least one token", param=param)
        self.check_token_ids(ids, param)
        if len(ids) >= self.context_length:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but the context length is "
                f"{self.context_length}; shorten the prompt",
                param=param,
            )
        return ids

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise InvalidRequestError(f"n must be <= {self.max_n} (--max-n), got {n}", param="n")

    def check_rid(self, rid) -> None:
        if rid is None:
            return
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError(f"'rid' must be a non-empty string, got {rid!r}", param="rid")
        if len(rid) > MAX_RID_CHARS:
            raise InvalidRequestError(
                f"'rid' has {len(rid)} characters; at most {MAX_RID_CHARS} are allowed",
                param="rid",
            )
        check_unicode(rid, "rid")

    def check_stops(self, params: SamplingParams) -> None:
        """At most `MAX_STOP_STRINGS` stop strings of at most `MAX_STOP_STRING_CHARS`
        characters (valid Unicode), at most `MAX_STOP_TOKEN_IDS` stop token ids."""
        stops = params.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"'stop' has {len(stops)} strings; this server takes at most {MAX_STOP_STRINGS}",
                param="stop",
            )
        for i, stop in enumerate(stops):
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"stop string {i} has {len(stop)} characters; this server takes at most "
                    f"{MAX_STOP_STRING_CHARS} per string",
                    param="stop",
                )
            check_unicode(stop, "stop")
        ids = params.stop_token_ids or ()
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"'stop_token_ids' has {len(ids)} ids; this server takes at most "
                f"{MAX_STOP_TOKEN_IDS}",
                param="stop_token_ids",
            )
        self.check_token_ids(ids, "stop_token_ids")

    def check_top_logprobs(self, top_logprobs_num) -> None:
        top = top_logprobs_num
        if (
            isinstance(top, bool)
            or not isinstance(top, int)
            or not 0 <= top <= min(self.max_top_logprobs, self.vocab_size)
        ):
            raise InvalidRequestError(
                f"top_logprobs_num must be an integer in [0, "
                f"{min(self.max_top_logprobs, self.vocab_size)}] (--max-top-logprobs), "
                f"got {top!r}",
                param="top_logprobs_num",
            )

    def check_logprob_entries(self, reqs: Sequence[Req]) -> None:
        """400 when the responses of `reqs` (one call's choices and prompts together)
        would carry more than `max_logprob_entries` logprob entries."""
        total = sum(logprob_entries(r) for r in reqs)
        if total <= self.max_logprob_entries:
            return
        if any(r.top_logprobs_num or r.token_ids_logprob for r in reqs):
            param = "top_logprobs_num"
        elif any(r.logprob_start_len >= 0 for r in reqs):
            param = "logprob_start_len"
        else:
            param = "max_new_tokens"
        raise InvalidRequestError(
            f"the response would carry {total} logprob entries: (prompt tokens scored from "
            "logprob_start_len + max_new_tokens) x (1 + top_logprobs_num + "
            "len(token_ids_logprob)), summed over every choice (n) and prompt; this server "
            f"sends at most {self.max_logprob_entries} (--max-logprob-entries). Lower "
            "max_new_tokens, top_logprobs_num or n, or score fewer prompt tokens",
            param=param,
        )


def logprob_entries(req: Req) -> int:
    """Logprob entries `req` can return at most: one per scored position for the token
    itself, plus one per top alternative and per `token_ids_logprob` id."""
    if not req.return_logprob:
        return 0
    width = 1 + req.top_logprobs_num + len(req.token_ids_logprob or ())
    scored_prompt = len(req.prompt_ids) - req.logprob_start_len if req.logprob_start_len >= 0 else 0
    return (scored_prompt + req.sampling_params.max_new_tokens) * width
