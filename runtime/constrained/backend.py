# SPDX-License-Identifier: Apache-2.0
"""`GrammarBackend`: compiles structured-output constraints with xgrammar and hands out
per-request matchers (SGLang's `XGrammarGrammarBackend`, vLLM's xgrammar backend).

Compilation is cached per (kind, source, whitespace setting) by xgrammar's own
`GrammarCompiler` cache, and is safe to call from several threads, so request handlers run
it off the event loop. A schema, regex or grammar xgrammar cannot compile is the caller's
error (`InvalidRequestError`, a 400 naming the parameter).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable

from runtime.constrained.request_grammar import RequestGrammar
from runtime.core.errors import InvalidRequestError

# Any JSON object (OpenAI's `response_format: {"type": "json_object"}`), as SGLang sends it.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarBackend:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        any_whitespace: bool = True,
        max_threads: int = 2,
    ):
        """`tokenizer`: the served transformers tokenizer; `vocab_size`: the model's logits
        width (may exceed the tokenizer's); `stop_token_ids`: the model's EOS ids, which end
        a completed grammar. `any_whitespace=False` makes JSON use xgrammar's compact
        layout (SGLang's `--constrained-json-disable-any-whitespace`)."""
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=True)
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        self._lock = threading.Lock()  # one compile at a time; the cache serves repeats

    def compile(self, kind: str, source: str):
        """xgrammar's `CompiledGrammar` for `kind` in json_schema / regex / ebnf."""
        try:
            with self._lock:
                if kind == "json_schema":
                    json.loads(source)  # a clear message for text that is not JSON
                    return self.compiler.compile_json_schema(
                        source, any_whitespace=self.any_whitespace
                    )
                if kind == "regex":
                    return self.compiler.compile_regex(source)
                if kind == "ebnf":
                    return self.compiler.compile_grammar(source)
        except json.JSONDecodeError as err:
            raise InvalidRequestError(f"json_schema is not valid JSON: {err}") from None
        except (RuntimeError, ValueError, TypeError) as err:
            raise InvalidRequestError(f"invalid {kind}: {_reason(err)}") from None
        raise InvalidRequestError(f"unknown grammar kind '{kind}'")

    def request_grammar(self, kind: str, source: str) -> RequestGrammar:
        """A fresh matcher at the start of the constraint."""
        compiled = self.compile(kind, source)
        return RequestGrammar(self._xgr.GrammarMatcher(compiled), (kind, source))


def _reason(err: Exception) -> str:
    """xgrammar's message without its log prefix (`[time] file.cc:line: `)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
