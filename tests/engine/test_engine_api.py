# SPDX-License-Identifier: Apache-2.0
"""The engine's public surface after the architecture pass: one configuration object for
`Engine` and `ServerArgs`, and the `n` fan-out shared by `Engine.generate`, SGLang's
`/generate` and the OpenAI routes."""

from __future__ import annotations

import dataclasses

import pytest

from runtime import Engine
from runtime.server.native_api import parse_generate
from runtime.server.openai_protocol import CompletionRequest, completion_requests
from runtime.server_args import ServerArgs

PROMPT = [5, 9, 13, 2, 40, 41]


@pytest.fixture(scope="module")
def engine(tiny_v4):
    return Engine(model_path=str(tiny_v4[0]), dtype="float32", page_size=4)


def test_keywords_and_server_args_build_the_same_engine(tiny_v4, engine):
    path = str(tiny_v4[0])
    args = ServerArgs.from_cli(["--model-path", path, "--dtype", "float32", "--page-size", "4"])
    other = Engine(args.engine_config())
    assert other.config == engine.config

    def steady(info):  # the process's peak RSS grows with whatever ran in between
        ranks = [{k: v for k, v in r.items() if k != "peak_rss"} for r in info.rank_memory]
        return dataclasses.replace(info, rank_memory=tuple(ranks))

    assert steady(other.info) == steady(engine.info)
    assert engine.scheduler.chunk_budget == 2048  # the one default, shared with the server
    assert engine.scheduler.max_running_requests == engine.info.max_running_requests == 64
    assert (
        other.generate(input_ids=PROMPT, sampling_params={"temperature": 0})["output_ids"]
        == engine.generate(input_ids=PROMPT, sampling_params={"temperature": 0})["output_ids"]
    )
    with pytest.raises(TypeError):
        Engine(model_path=path, no_such_setting=1)


def test_n_choices_are_the_single_requests_with_offset_seeds(engine):
    params = {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 42}
    choices = engine.generate(input_ids=PROMPT, sampling_params={**params, "n": 3})
    assert len(choices) == 3
    base = choices[0]["meta_info"]["id"][: -len("-0")]
    assert [c["meta_info"]["id"] for c in choices] == [f"{base}-{k}" for k in range(3)]
    for k, choice in enumerate(choices):
        single = engine.generate(
            input_ids=PROMPT, sampling_params={**params, "sampling_seed": 42 + k}
        )
        assert choice["output_ids"] == single["output_ids"]
    assert len({tuple(c["output_ids"]) for c in choices}) > 1


def test_native_and_openai_routes_fan_out_like_the_engine(engine):
    call = parse_generate(
        {"input_ids": PROMPT, "rid": "q", "sampling_params": {"n": 2, "sampling_seed": 7}},
        engine,
    )
    native = call.requests
    assert [r.rid for r in native] == ["q-0", "q-1"]
    assert [r.sampling_params.sampling_seed for r in native] == [7, 8]
    body = CompletionRequest(prompt=[PROMPT, PROMPT[:3]], n=2, seed=7, max_tokens=4)
    openai = completion_requests(body, engine)
    assert [r.sampling_params.sampling_seed for r in openai] == [7, 8, 7, 8]
    assert [r.prompt_ids for r in openai] == [PROMPT, PROMPT, PROMPT[:3], PROMPT[:3]]
    assert [r.rid[-2:] for r in openai] == ["-0", "-1", "-0", "-1"]
    assert len({r.rid for r in openai}) == 4


def test_native_rid_must_match_the_batch(engine):
    from runtime.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="one id per prompt"):
        parse_generate({"input_ids": [PROMPT, PROMPT], "rid": "same"}, engine)
    with pytest.raises(InvalidRequestError, match="'rid' list must have one entry per prompt"):
        parse_generate({"input_ids": [PROMPT, PROMPT], "rid": ["a"]}, engine)
    with pytest.raises(InvalidRequestError, match="'rid' must be str"):
        parse_generate({"input_ids": PROMPT, "rid": 5}, engine)
    call = parse_generate({"input_ids": [PROMPT, PROMPT], "rid": ["a", "b"]}, engine)
    assert [r.rid for r in call.requests] == ["a", "b"]
