# SPDX-License-Identifier: Apache-2.0
"""`StopStrings`: a request's stop strings, compiled once, matched without a loop over them.

Two questions are asked of the generated text after every token:

* `find(text, start)`: the earliest occurrence of any stop string starting at or after
  `start`, and at that position the shortest one (what `min((text.find(s, start), s))`
  over the strings gives), by one regular expression written as a trie.
* `held(text)`: how many trailing characters could still begin a stop string (a streamed
  snapshot holds them back): the longest suffix of `text` that is a proper prefix of some
  stop string, by binary search over the sorted strings.

Both cost time in the length of the window (the longest stop string plus the new text),
not in the number of strings, beyond a logarithm and the regex engine's per-position branch
test (the count itself is capped in `engine/request_limits.py`). How the trie and the
search work: `_trie_pattern` and docs/serving_limits.md, "Module notes".
"""

from __future__ import annotations

import bisect
import functools
import re
from collections.abc import Iterable


class StopStrings:
    def __init__(self, stops: Iterable[str]):
        self.strings = sorted(set(stops))
        self.longest = max((len(s) for s in self.strings), default=0)
        self._pattern = re.compile(_trie_pattern(self.strings))
        self._first_chars = frozenset(s[0] for s in self.strings if s)

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(stops: tuple[str, ...]) -> StopStrings:
        """The compiled set of `stops`, shared by every request (and choice) sending it."""
        return StopStrings(stops)

    def __bool__(self) -> bool:
        return bool(self.strings)

    def find(self, text: str, start: int) -> tuple[int, str] | None:
        """(index, stop string) of the earliest match at or after `start`, else None."""
        if not self.strings or start > len(text):
            return None
        match = self._pattern.search(text, start)
        return None if match is None else (match.start(), match.group())

    def held(self, text: str) -> int:
        """Length of the longest suffix of `text` that a stop string continues (0: none)."""
        span = min(self.longest - 1, len(text))
        if span <= 0:
            return 0
        base = len(text) - span
        strings, count = self.strings, len(self.strings)
        for i in range(base, len(text)):
            if text[i] not in self._first_chars:
                continue
            tail = text[i:]
            j = bisect.bisect_left(strings, tail)
            # the strings starting with `tail` sit together from j on; one that equals it
            # is not a proper continuation, the next one (longer) may be
            if j < count and strings[j] == tail:
                j += 1
            if j < count and strings[j].startswith(tail):
                return len(text) - i
        return 0


_END = ""  # a trie node's key marking that a string ends there (no character is empty)


def _trie_pattern(strings: list[str]) -> str:
    """The regex of `strings` as a trie: at a node the empty branch (a string ends) comes
    first, then one branch per next character; runs without a fork are one literal, so the
    nesting is at most as deep as the number of strings."""
    root: dict = {}
    for text in strings:
        node = root
        for char in text:
            node = node.setdefault(char, {})
        node[_END] = True

    def branches(node: dict) -> str:
        parts = [""] if _END in node else []
        for char in sorted(k for k in node if k != _END):
            child, run = node[char], char
            while _END not in child and len(child) == 1:
                ((char, child),) = child.items()
                run += char
            parts.append(re.escape(run) + branches(child))
        if len(parts) == 1:
            return parts[0]
        return "(?:" + "|".join(parts) + ")"

    return branches(root)
