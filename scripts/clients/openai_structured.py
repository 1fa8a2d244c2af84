# SPDX-License-Identifier: Apache-2.0
"""The `openai` SDK against a running server: structured output with `response_format`
(json_schema and json_object) on chat and completions, `echo` + `logprobs`, model
retrieval. Prints one `openai: ...` line per check.

    python scripts/clients/openai_structured.py http://127.0.0.1:30000/v1
"""

from __future__ import annotations

import json
import sys

import jsonschema
import openai

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "lines": {"type": "integer", "minimum": 1, "maximum": 500},
        "tags": {"type": "array", "items": {"enum": ["io", "math", "text"]}, "maxItems": 3},
    },
    "required": ["name", "lines", "tags"],
    "additionalProperties": False,
}


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"openai: {name:<28} {'ok' if ok else 'FAILED'}  {detail}", flush=True)
    return ok


def valid_json(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:30000/v1"
    client = openai.OpenAI(base_url=base_url, api_key="none")
    model = client.models.list().data[0].id
    results = [check("models.retrieve", client.models.retrieve(model).id == model, model)]
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "module", "schema": SCHEMA, "strict": True},
    }
    chat = client.chat.completions.create(
        model="default",  # any name is served
        messages=[{"role": "user", "content": "Describe the module os.path as JSON."}],
        response_format=schema_format,
        temperature=0,
        max_tokens=64,
    )
    text = chat.choices[0].message.content
    results.append(check("chat json_schema", valid_json(text, SCHEMA), text))
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Any JSON object."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=64,
    )
    text = chat.choices[0].message.content
    results.append(check("chat json_object", valid_json(text, {"type": "object"}), text))
    completion = client.completions.create(
        model=model,
        prompt="settings = ",
        max_tokens=64,
        temperature=0,
        extra_body={"response_format": schema_format},
    )
    text = completion.choices[0].text
    results.append(check("completions json_schema", valid_json(text, SCHEMA), text))
    echoed = client.completions.create(
        model=model, prompt="import os\n", max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    lp = echoed.choices[0].logprobs
    ok = (
        echoed.choices[0].text.startswith("import os\n")
        and lp.token_logprobs[0] is None
        and all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
        and len(lp.tokens) == echoed.usage.prompt_tokens + 1
    )
    results.append(check("echo + logprobs", ok, f"{len(lp.tokens)} tokens, first {lp.tokens[0]!r}"))
    try:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
        refused = False
    except openai.BadRequestError as err:
        refused = "tools" in str(err)
    results.append(check("tools refused (400)", refused, ""))
    print(f"openai: {sum(results)} of {len(results)} checks passed")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
