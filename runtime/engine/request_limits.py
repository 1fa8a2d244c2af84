# SPDX-License-Identifier: Apache-2.0
"""What a request may ask for, checked before it reaches the scheduler.

Every value a client sends is checked here or in `SamplingParams.normalize`, so nothing
that passes can fail inside an engine step: token ids inside the vocabulary wherever they
appear, text that is valid Unicode (no lone surrogates: JSON can carry them, UTF-8 cannot),
at most `max_n` choices, and a prompt the context length and the KV pool can hold (SGLang's
`max_req_input_len` rule in `scheduler.py`, without auto-truncation).

Prompt text is measured before it is tokenized: no token of the vocabulary is longer than
`longest_token_chars`, so a text longer than `context_length * longest_token_chars`
characters cannot fit the context (unless the tokenizer's normalizer deletes characters,
which no tokenizer this runtime ships does), and tokenizing it would only burn memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from runtime.core.errors import InvalidRequestError

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
