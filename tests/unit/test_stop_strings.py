# SPDX-License-Identifier: Apache-2.0
"""The stop-string matcher against its naive re-statement: the per-string loops `Req` ran
before (`min((text.find(s, start), s))` over the strings, and for the held-back tail the
longest `text.endswith(stop[:k])` of each). Random texts and stop sets over a small
alphabet with multi-byte characters, so stops overlap, nest, share prefixes and span the
boundaries of the pieces a detokenizer emits; empty pieces (an unfinished UTF-8 sequence)
and `min_new_tokens` (checks skipped at first) included."""

from __future__ import annotations

import random

import pytest

from runtime.core.request import Req
from runtime.core.sampling_params import SamplingParams
from runtime.core.stop_strings import StopStrings

ALPHABET = "ab\né中😀"


def naive_find(text: str, start: int, stops: list[str]):
    hits = [(text.find(s, start), s) for s in stops]
    hits = [(i, s) for i, s in hits if i >= 0]
    return min(hits) if hits else None


def naive_held(text: str, stops: list[str]) -> int:
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return hold


def random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(length))


def random_stops(rng: random.Random, text: str, allow_empty: bool = True) -> list[str]:
    """Pieces of `text` (so they match), their prefixes and extensions, and random ones."""
    stops = []
    for _ in range(rng.randint(1, 8)):
        kind = rng.random()
        if kind < 0.5 and text:
            i = rng.randrange(len(text))
            stops.append(text[i : i + rng.randint(1, 6)])
        elif kind < 0.7 and stops:
            base = rng.choice(stops)
            stops.append(base[: rng.randint(0, len(base))] + random_text(rng, rng.randint(0, 3)))
        elif kind < 0.75 and allow_empty:
            stops.append("")
        else:
            stops.append(random_text(rng, rng.randint(1, 5)))
    return stops


@pytest.mark.parametrize("seed", range(40))
def test_find_and_held_match_the_naive_loops(seed):
    rng = random.Random(seed)
    for _ in range(50):
        text = random_text(rng, rng.randint(0, 30))
        stops = random_stops(rng, text)
        matcher = StopStrings(stops)
        for start in range(len(text) + 2):
            assert matcher.find(text, start) == naive_find(text, start, stops), (text, stops)
        for end in range(len(text) + 1):
            assert matcher.held(text[:end]) == naive_held(text[:end], stops), (text, stops)


class PieceDetokenizer:
    """Emits fixed text pieces, one per token (an empty piece: a character still open)."""

    def __init__(self, pieces: list[str]):
        self.pieces, self.text = list(pieces), ""

    def add(self, token: int) -> str:
        piece = self.pieces[token]
        self.text += piece
        return piece

    def flush(self) -> str:
        return ""


def naive_run(pieces: list[str], stops: list[str], params: SamplingParams):
    """What `Req.append_token` did with the per-string loops: (final text, matched stop or
    None, visible text after each token)."""
    text, visible = "", []
    longest = max(len(s) for s in stops)
    for produced, piece in enumerate(pieces, start=1):
        text += piece
        if produced >= params.min_new_tokens:
            start = max(0, len(text) - len(piece) - longest + 1)
            hit = naive_find(text, start, stops)
            if hit is not None:
                index, stop = hit
                text = text[: index + len(stop) if params.no_stop_trim else index]
                visible.append(text)
                return text, stop, visible
        finished = produced == params.max_new_tokens  # the whole text shows once finished
        visible.append(text if finished else text[: len(text) - naive_held(text, stops)])
    return text, None, visible


@pytest.mark.parametrize("seed", range(60))
def test_a_request_stops_and_streams_as_the_naive_loops_did(seed):
    rng = random.Random(1000 + seed)
    for _ in range(20):
        pieces = [random_text(rng, rng.choice([0, 1, 1, 2, 3, 5])) for _ in range(12)]
        stops = random_stops(rng, "".join(pieces), allow_empty=rng.random() < 0.1)
        params = SamplingParams(
            max_new_tokens=len(pieces),
            min_new_tokens=rng.choice([0, 0, 3, 8]),
            stop=stops if len(stops) > 1 or rng.random() < 0.5 else stops[0],
            no_stop_trim=rng.random() < 0.3,
        )
        req = Req("r", [1], params, detokenizer=PieceDetokenizer(pieces))
        visible = []
        for token in range(len(pieces)):
            req.append_token(token, eos_ids=set())
            visible.append(req.visible_text())
            if req.finished:
                break
        text, matched, expected_visible = naive_run(pieces, stops, params)
        assert req.text == text, (pieces, stops)
        if matched is None:
            assert req.finish_reason.type == "length"
        else:
            assert req.finish_reason.type == "stop" and req.finish_reason.matched == matched
        assert visible == expected_visible, (pieces, stops)


def test_many_long_stops_are_one_compiled_set():
    """64 strings of 256 characters (the request limits' ceiling) that share a prefix:
    still the naive answer, and one shared compiled object per distinct set."""
    rng = random.Random(7)
    stops = ["ab" * 100 + random_text(rng, 56) for _ in range(64)]
    text = random_text(rng, 300) + stops[17] + random_text(rng, 20)
    matcher = StopStrings.of(tuple(stops))
    assert matcher is StopStrings.of(tuple(stops))
    for start in (0, 150, 300, 301):
        assert matcher.find(text, start) == naive_find(text, start, stops)
    for end in (299, 300, 400, 555, len(text)):
        assert matcher.held(text[:end]) == naive_held(text[:end], stops)
