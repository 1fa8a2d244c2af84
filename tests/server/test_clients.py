# SPDX-License-Identifier: Apache-2.0
"""Real clients' requests, replayed: the exact JSON that SGLang's frontend (`sgl.gen`,
`sgl.select`), lm-eval's `local-completions` and the `openai` SDK sent to this server
(recorded with scripts/record_client_requests.py while scripts/check_clients.sh ran; see
tests/data/clients/), asserting values against oracles:

* prompt logprobs equal transformers' teacher-forced forward of the same tokens (the
  embedded default model, fp32), through chunked prefill, plain and NEXTN;
* `select` picks the choice whose tokens have the highest summed logprob under that oracle;
* structured output validates against its JSON schema (`jsonschema`) / fully matches its
  regex, and NEXTN's greedy constrained output equals plain decoding's.

The servers are in process (FastAPI's TestClient over an `AsyncEngine`) on the embedded
model, whose tokenizer prepends `<|bos|>`; nothing is installed at test time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from fastapi.testclient import TestClient

from runtime.engine.async_engine import AsyncEngine
from runtime.engine.engine import DEFAULT_MODEL_DIR, Engine
from runtime.server.app import create_app
from runtime.server_args import ServerArgs

DATA = Path(__file__).resolve().parents[1] / "data" / "clients"
LOGPROB_ATOL = 2e-3  # ours (chunked, fp32) vs transformers (one pass, fp32)


def recorded(name: str) -> list[dict]:
    """The requests one client sent, in order: {"method", "path", "body"}."""
    return json.loads((DATA / f"{name}.json").read_text())["requests"]


@pytest.fixture(scope="module")
def servers():
    """Plain and NEXTN servers on the embedded model; prefill in chunks of 8 tokens so
    every prompt here is split across steps."""
    clients, runners = {}, []
    for mode, algorithm in (("plain", None), ("nextn", "NEXTN")):
        engine = Engine(
            dtype="float32",
            chunked_prefill_size=8,
            max_total_tokens=16384,
            speculative_algorithm=algorithm,
            constrained_json_disable_any_whitespace=True,
        )
        runner = AsyncEngine(engine)
        runners.append(runner)
        clients[mode] = TestClient(create_app(runner, ServerArgs(model_path=engine.model_path)))
    yield clients
    for runner in runners:
        runner.shutdown()


@pytest.fixture(scope="module")
def oracle():
    """(tokenizer, teacher-forced logprobs of ids[1:] given the prefix, from transformers)."""
    from transformers import DeepseekV4ForCausalLM

    from runtime.engine.tokenizer import load_tokenizer

    model = DeepseekV4ForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32)
    model.eval()
    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR, required=True)

    @torch.no_grad()
    def logprobs(ids: list[int]) -> torch.Tensor:
        logits = model(torch.tensor([ids])).logits[0].float()
        rows = torch.log_softmax(logits[:-1], dim=-1)
        return rows.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)

    def full_rows(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    logprobs.rows = full_rows
    return tokenizer, logprobs


def post(client: TestClient, request: dict) -> dict:
    response = client.request(request["method"], request["path"], json=request["body"])
    assert response.status_code == 200, response.text
    return response.json()


def assert_prompt_logprobs(entries, ids: list[int], start: int, oracle_logprobs) -> None:
    """SGLang's `input_token_logprobs` from `start`: [logprob, id, text] per prompt token,
    None only for the prompt's first token, the values transformers' teacher forcing gives."""
    assert [e[1] for e in entries] == ids[start:]
    expected = oracle_logprobs(ids)  # [len - 1]: token p given tokens < p, for p >= 1
    for k, (value, _, _) in enumerate(entries):
        position = start + k
        if position == 0:
            assert value is None
        else:
            assert value == pytest.approx(expected[position - 1].item(), abs=LOGPROB_ATOL)


# -- SGLang frontend --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["plain", "nextn"])
def test_sgl_select_replay_scores_every_choice_and_picks_the_likeliest(servers, oracle, mode):
    """`sgl.select`: a `max_new_tokens: 0` call for the prompt length, then every choice
    scored with `return_logprob`, `logprob_start_len` and `return_text_in_logprobs`."""
    tokenizer, oracle_logprobs = oracle
    prefix_call, scoring_call = recorded("sgl_select")
    prefix = post(servers[mode], prefix_call)
    text = prefix_call["body"]["text"]
    assert prefix["meta_info"]["prompt_tokens"] == len(tokenizer.encode(text))
    assert prefix["output_ids"] == [] and prefix["meta_info"]["finish_reason"]["length"] == 0

    prefix_ids = tokenizer.encode(text)
    body = scoring_call["body"]
    results = post(servers[mode], scoring_call)
    start = body["logprob_start_len"]
    sums, oracle_sums = [], []
    for choice_text, result in zip(body["text"], results):
        ids = tokenizer.encode(choice_text)
        entries = result["meta_info"]["input_token_logprobs"]
        assert_prompt_logprobs(entries, ids, start, oracle_logprobs)
        # the text slot the frontend reads (`input_token_logprobs[i][0][-1]`)
        assert [e[2] for e in entries] == [tokenizer.decode([t]) for t in ids[start:]]
        assert result["output_ids"] == [] and result["meta_info"]["output_token_logprobs"] == []
        # the choice's tokens: from the first one that differs from the prompt's own (the
        # prompt's last token may merge with the choice, as SGLang's token healing expects)
        first = next(p for p, (a, b) in enumerate(zip(ids, prefix_ids + [-1] * len(ids))) if a != b)
        sums.append(sum(e[0] for e in entries[first - start :]))
        oracle_sums.append(oracle_logprobs(ids)[first - 1 :].sum().item())
    assert max(range(len(sums)), key=sums.__getitem__) == max(
        range(len(oracle_sums)), key=oracle_sums.__getitem__
    )


@pytest.mark.parametrize("mode", ["plain", "nextn"])
def test_sgl_gen_replay_with_regex_and_schema_fields_sent_empty(servers, mode):
    """`sgl.gen` always sends `regex`, `json_schema` and `stop_regex` (null or empty) and the
    rest of its sampling fields; a `regex=` gen's output fully matches it."""
    for call in recorded("sgl_gen"):
        out = post(servers[mode], call)
        params = call["body"]["sampling_params"]
        if params.get("regex"):
            assert re.fullmatch(params["regex"], out["text"]), (params["regex"], out["text"])
        if params.get("json_schema"):
            jsonschema.validate(json.loads(out["text"]), json.loads(params["json_schema"]))


# -- lm-eval ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["plain", "nextn"])
def test_lm_eval_loglikelihood_replay_gets_the_prompt_logprobs(servers, oracle, mode):
    """lm-eval's `local-completions` loglikelihood: token-id prompts with `echo`,
    `logprobs: 1`, `max_tokens: 1`; it reads `token_logprobs[ctxlen:-1]` and the top entry
    of each position. Prompt entries equal transformers' teacher forcing, first null."""
    _, oracle_logprobs = oracle
    for call in recorded("lm_eval_loglikelihood"):
        response = post(servers[mode], call)
        prompts = call["body"]["prompt"]
        assert len(response["choices"]) == len(prompts)
        for ids, choice in zip(prompts, sorted(response["choices"], key=lambda c: c["index"])):
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(ids) + 1
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            expected = oracle_logprobs(ids)
            torch.testing.assert_close(
                torch.tensor(lp["token_logprobs"][1 : len(ids)]),
                expected,
                atol=LOGPROB_ATOL,
                rtol=0,
            )
            for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
                assert len(top) == 1 and max(top.values()) >= value - 1e-5


@pytest.mark.parametrize("mode", ["plain", "nextn"])
def test_lm_eval_generate_until_replay(servers, mode):
    for call in recorded("lm_eval_generate_until"):
        response = post(servers[mode], call)
        stops = call["body"]["stop"]
        for choice in response["choices"]:
            assert not any(stop in choice["text"] for stop in stops)


def test_nextn_generate_until_equals_plain(servers):
    for call in recorded("lm_eval_generate_until"):
        plain, nextn = post(servers["plain"], call), post(servers["nextn"], call)
        assert [c["text"] for c in plain["choices"]] == [c["text"] for c in nextn["choices"]]


# -- openai SDK -------------------------------------------------------------------------


def test_openai_structured_output_replay_validates_and_nextn_equals_plain(servers):
    """The openai SDK's chat request with `response_format` json_schema (and json_object):
    the content validates against the schema, and NEXTN's greedy output is plain's."""
    for call in recorded("openai_structured"):
        outputs = {mode: post(servers[mode], call) for mode in ("plain", "nextn")}
        body = call["body"]
        fmt = body.get("response_format") or body.get("extra_body", {}).get("response_format")
        schema = (
            fmt["json_schema"]["schema"] if fmt["type"] == "json_schema" else {"type": "object"}
        )
        texts = []
        for out in outputs.values():
            choice = out["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            jsonschema.validate(json.loads(text), schema)
            texts.append(text)
        assert texts[0] == texts[1]


# -- engine-level properties the clients rely on ------------------------------------------


REGEX = r"    return [a-z_]{1,12} \+ [a-z]{1,5}\n"
EBNF = 'root ::= "self." [a-z]+ " = " ("None" | "0" | "[]")'
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}


def test_greedy_constrained_output_is_the_same_with_and_without_nextn(servers):
    cases = [
        ("def add(a, b):\n", {"regex": REGEX}),
        ("class Foo:\n    def __init__(self):\n        ", {"ebnf": EBNF}),
        ("settings = ", {"json_schema": json.dumps(SCHEMA)}),
    ]
    for prompt, grammar in cases:
        body = {
            "text": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": 40, **grammar},
        }
        plain = servers["plain"].post("/generate", json=body).json()
        nextn = servers["nextn"].post("/generate", json=body).json()
        assert plain["output_ids"] == nextn["output_ids"], grammar
        text = plain["text"]
        if "regex" in grammar:
            assert re.fullmatch(REGEX, text)
        if "json_schema" in grammar:
            jsonschema.validate(json.loads(text), SCHEMA)
        if "ebnf" in grammar:
            assert (
                re.fullmatch(r"self\.[a-z]+ = (None|0|\[\])", text)
                or len(plain["output_ids"]) == 40
            )
    # the speed-up holds under a grammar: drafts are proposed grammatically
    assert nextn["meta_info"]["spec_accept_length"] > 1.5


def test_sampled_constrained_output_obeys_the_grammar_under_nextn(servers):
    body = {
        "text": ["def f(x):\n"] * 4,
        "sampling_params": {
            "temperature": 1.0,
            "max_new_tokens": 40,
            "regex": REGEX,
            "sampling_seed": 7,
        },
    }
    for out in servers["nextn"].post("/generate", json=body).json():
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert re.fullmatch(REGEX, out["text"])
        else:
            assert re.fullmatch(r"    return [a-z_]{0,12}( \+ [a-z]{0,5})?", out["text"])


@pytest.mark.parametrize("mode", ["plain", "nextn"])
def test_scoring_request_returns_prompt_logprobs_tops_token_ids_and_texts(servers, oracle, mode):
    """`max_new_tokens: 0` runs the prefill (chunked here) and returns the prompt's
    logprobs, top lists and `token_ids_logprob` lists, text slots filled."""
    tokenizer, oracle_logprobs = oracle
    text = "import os\nimport sys\n\ndef main(argv):\n    return 0\n"
    ids = tokenizer.encode(text)
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "token_ids_logprob": [ids[1], 8],
        "return_text_in_logprobs": True,
    }
    meta = servers[mode].post("/generate", json=body).json()["meta_info"]
    assert meta["prompt_tokens"] == len(ids) > 8 and meta["completion_tokens"] == 0
    assert_prompt_logprobs(meta["input_token_logprobs"], ids, 0, oracle_logprobs)
    rows = oracle_logprobs.rows(ids)
    assert meta["input_top_logprobs"][0] is None and meta["input_token_ids_logprobs"][0] is None
    for p in range(1, len(ids)):
        top = meta["input_top_logprobs"][p]
        values, top_ids = rows[p - 1].topk(3)
        assert [t for _, t, _ in top] == top_ids.tolist()
        assert [lp for lp, _, _ in top] == pytest.approx(values.tolist(), abs=LOGPROB_ATOL)
        assert [s for _, _, s in top] == [tokenizer.decode([t]) for t in top_ids.tolist()]
        wanted = meta["input_token_ids_logprobs"][p]
        assert [t for _, t, _ in wanted] == [ids[1], 8]
        assert [lp for lp, _, _ in wanted] == pytest.approx(
            [rows[p - 1][ids[1]].item(), rows[p - 1][8].item()], abs=LOGPROB_ATOL
        )


def test_prompt_logprobs_equal_the_logprobs_plain_decoding_gave(servers, oracle):
    """Teacher forcing of generated text: scoring prompt + generated tokens gives, for the
    generated ones, the logprobs decoding reported (prefill rows vs decode steps)."""
    tokenizer, _ = oracle
    prompt = "def read(path):\n"
    for mode in ("plain", "nextn"):
        client = servers[mode]
        generated = client.post(
            "/generate",
            json={
                "text": prompt,
                "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
                "return_logprob": True,
            },
        ).json()
        prompt_len = generated["meta_info"]["prompt_tokens"]
        scored = client.post(
            "/generate",
            json={
                "input_ids": tokenizer.encode(prompt) + generated["output_ids"],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": prompt_len,
            },
        ).json()
        entries = scored["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == generated["output_ids"]
        torch.testing.assert_close(
            torch.tensor([e[0] for e in entries]),
            torch.tensor([e[0] for e in generated["meta_info"]["output_token_logprobs"]]),
            atol=1e-4,
            rtol=0,
        )


# -- OpenAI echo, names, fields -----------------------------------------------------------


def test_echo_shows_the_prompt_without_the_bos_the_tokenizer_adds(servers, oracle):
    tokenizer, oracle_logprobs = oracle
    out = (
        servers["plain"]
        .post(
            "/v1/completions",
            json={
                "prompt": "import os\n",
                "max_tokens": 2,
                "temperature": 0,
                "logprobs": 2,
                "echo": True,
            },
        )
        .json()
    )
    choice = out["choices"][0]
    ids = tokenizer.encode("import os\n")
    assert ids[0] == tokenizer.bos_token_id
    assert choice["text"].startswith("import os\n") and "<|bos|>" not in choice["text"]
    lp = choice["logprobs"]
    assert lp["tokens"][: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    torch.testing.assert_close(
        torch.tensor(lp["token_logprobs"][1 : len(ids)]),
        oracle_logprobs(ids),
        atol=LOGPROB_ATOL,
        rtol=0,
    )
    assert len(lp["tokens"]) == len(ids) + 2 and all(len(t) == 2 for t in lp["top_logprobs"][1:])
    # streaming: the first chunk carries the echo and the prompt's logprobs
    with servers["plain"].stream(
        "POST",
        "/v1/completions",
        json={
            "prompt": "import os\n",
            "max_tokens": 2,
            "temperature": 0,
            "logprobs": 0,
            "echo": True,
            "stream": True,
        },
    ) as response:
        chunks = [
            json.loads(line[6:])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    assert chunks[0]["choices"][0]["text"].startswith("import os\n")
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == choice["text"]


def test_every_default_valued_sglang_field_is_accepted_and_set_ones_are_refused(servers):
    """sglang-router forwards SGLang's whole `GenerateReqInput` (and `SamplingParams`)
    filled in with defaults; a set unsupported field is a 400 naming it."""
    full = json.loads((DATA / "generate_full_schema.json").read_text())["body"]
    client = servers["plain"]
    out = client.post("/generate", json=full)
    assert out.status_code == 200, out.text
    plain = client.post(
        "/generate",
        json={"text": full["text"], "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    ).json()
    assert out.json()["output_ids"] == plain["output_ids"]
    for name, value in (
        ("return_hidden_states", True),
        ("lora_path", "adapter"),
        ("image_data", "x.png"),
    ):
        response = client.post("/generate", json={**full, name: value})
        assert response.status_code == 400 and name in response.json()["error"]["message"]
    for name, value in (
        ("stop_regex", "\\n"),
        ("logit_bias", {"5": 1.0}),
        ("structural_tag", "{}"),
    ):
        body = {**full, "sampling_params": {**full["sampling_params"], name: value}}
        response = client.post("/generate", json=body)
        assert response.status_code == 400 and name in response.json()["error"]["message"]
    response = client.post("/generate", json={**full, "no_such_field": 1})
    assert response.status_code == 400 and "no_such_field" in response.json()["error"]["message"]


BAD = [
    ("/generate", {"text": "x", "sampling_params": {"regex": "(unclosed"}}, "invalid regex"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}, "json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": '{"type": "objet"}'}}, "objet"),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= "}}, "invalid ebnf"),
    (
        "/generate",
        {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
        "at most one",
    ),
    (
        "/generate",
        {"text": "x", "return_logprob": True, "token_ids_logprob": [99999]},
        "token_ids_logprob",
    ),
    (
        "/generate",
        {"text": "x", "return_logprob": True, "logprob_start_len": 99},
        "logprob_start_len",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "tools",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
        "schema",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "hi"}]}, "chat template"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 2}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "guided_json": {}}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "regex": "(("}, "invalid regex"),
]


@pytest.mark.parametrize("path,body,message", BAD)
def test_unsupported_or_invalid_input_is_a_400_naming_it(servers, path, body, message):
    response = servers["plain"].post(path, json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_any_model_name_is_served_and_no_response_shows_a_filesystem_path(servers):
    client = servers["plain"]
    name = DEFAULT_MODEL_DIR.name
    for model in ("default", "gpt-4o", name, None):
        body = {"prompt": "x", "max_tokens": 1, **({"model": model} if model else {})}
        assert client.post("/v1/completions", json=body).status_code == 200
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [name]
    assert client.get(f"/v1/models/{name}").json()["id"] == name
    missing = client.get("/v1/models/gpt-4o")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    for path in (
        "/v1/models",
        "/model_info",
        "/get_model_info",
        "/server_info",
        "/get_server_info",
    ):
        response = client.get(path)
        assert response.status_code == 200
        assert (
            str(DEFAULT_MODEL_DIR) not in response.text and "/runtime/assets" not in response.text
        )
    assert client.get("/model_info").json()["model_path"] == name
