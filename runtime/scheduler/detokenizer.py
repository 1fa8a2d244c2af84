# SPDX-License-Identifier: Apache-2.0
"""Incremental detokenization: text grows token by token without re-decoding everything.

Decodes a short window `ids[prefix_offset:]` and emits what it adds over
`ids[prefix_offset:read_offset]`; a window ending in an incomplete UTF-8 sequence (U+FFFD)
waits for the next token. The window keeps a few tokens of left context so tokenizers
that drop a leading space on the first token of a decode still place it right.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.kwargs)

    def add(self, token: int) -> str:
        """Append a token; returns the text it completed (possibly empty)."""
        self.ids.append(token)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever an unfinished character sequence decodes to."""
        rest = self._decode(self.ids[self.prefix_offset :])
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        delta = rest[len(prefix_text) :] if len(rest) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
