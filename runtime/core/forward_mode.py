# SPDX-License-Identifier: Apache-2.0
"""What kind of forward a batch runs, and what hidden states it hands back."""

from __future__ import annotations

import enum


class ForwardMode(enum.IntEnum):
    """EXTEND: new tokens on top of a (possibly empty) cached prefix, ragged per request;
    this covers prefill, chunked prefill and batches that mix prefill with decode rows.
    DECODE: exactly one new token per request.
    TARGET_VERIFY: the target scores `[t_last, d1..dS]` per request, causally, in one pass.
    DRAFT_EXTEND: the draft runs over target rows (prompt or verified tokens).
    IDLE: nothing to run (kept for symmetry with data-parallel engines)."""

    EXTEND = 1
    DECODE = 2
    TARGET_VERIFY = 3
    DRAFT_EXTEND = 4
    IDLE = 5

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_target_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self is ForwardMode.DRAFT_EXTEND

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE


class CaptureHiddenMode(enum.IntEnum):
    """NULL: no hidden states. LAST: at the rows logits are taken for. FULL: every input row."""

    NULL = 0
    LAST = 1
    FULL = 2

    def need_capture(self) -> bool:
        return self is not CaptureHiddenMode.NULL
