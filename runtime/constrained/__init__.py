# SPDX-License-Identifier: Apache-2.0
"""Structured output (`json_schema`, `regex`, `ebnf`) on xgrammar, as SGLang's and vLLM's
xgrammar backends do it.

* `GrammarBackend` compiles a request's constraint once per schema (xgrammar's compiler
  cache) and hands each request its own `RequestGrammar` matcher.
* `bitmask` prepares the token bitmasks of a step before its forward (one row per sampled
  or verified logits row) and applies them to the logits after it, so the forward itself
  stays free of host work.
* `RequestGrammar` follows the committed output (`Req.append_token` feeds it); a
  speculative verify walks it over the drafts tentatively and rolls it back.

This package imports only `runtime.core` and xgrammar.
"""
