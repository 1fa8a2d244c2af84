# SPDX-License-Identifier: Apache-2.0
"""The `n` fan-out: one prompt asking for `n` choices becomes `n` requests.

Written once, used by `Engine.generate`, SGLang's `/generate` and the OpenAI routes. Choice
`k` gets the id `<rid>-<k>` (SGLang's naming for `n > 1`; the bare `rid` when `n == 1`) and
the seed `sampling_seed + k`: seeded choices differ from each other, yet the whole request
reproduces (OpenAI's `seed` with `n`).
"""

from __future__ import annotations

import dataclasses

from runtime.core.sampling_params import SamplingParams


def choice_rid(rid: str, n: int, choice: int) -> str:
    return rid if n == 1 else f"{rid}-{choice}"


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """Choice `choice`'s parameters: the same, one choice, its own seed."""
    seed = None if params.sampling_seed is None else params.sampling_seed + choice
    return dataclasses.replace(params, n=1, sampling_seed=seed)


def fan_out(params: SamplingParams, rid: str) -> list[tuple[str, SamplingParams]]:
    """(request id, parameters) of each of the `params.n` choices, in choice order."""
    return [(choice_rid(rid, params.n, k), choice_params(params, k)) for k in range(params.n)]
