# SPDX-License-Identifier: Apache-2.0
"""SGLang's frontend language against a running server, unchanged (`RuntimeEndpoint`):
gen, select, gen(choices=), regex=, json_schema=, dtype=int, fork, run_batch, streaming.
Checks what it can check from outside and prints one `sgl: ...` line per feature.

    python scripts/clients/sgl_program.py http://127.0.0.1:30000
"""

from __future__ import annotations

import json
import re
import sys

import sglang as sgl

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "ok"],
    "additionalProperties": False,
}
KINDS = ["math", "string", "file"]


@sgl.function
def describe(s, name):
    s += f"def {name}(a, b):\n    return"
    s += sgl.gen("body", max_tokens=12, stop="\n", temperature=0)
    s += "\n# kind: " + sgl.select("kind", choices=KINDS)
    s += "\nx = " + sgl.gen("number", regex=r"[0-9]{1,3}", temperature=0)
    s += "\ny = " + sgl.gen("integer", dtype=int, max_tokens=6, temperature=0)
    s += "\nmode = " + sgl.gen("mode", choices=["'r'", "'w'", "'rb'"])
    s += "\nconfig = " + sgl.gen("config", json_schema=json.dumps(SCHEMA), max_tokens=48)


@sgl.function
def branches(s):
    s += "import os\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"def helper_{i}(path):\n    return"
        f += sgl.gen("body", max_tokens=10, stop="\n", temperature=0)
    s += "# " + forks[0]["body"] + " | " + forks[1]["body"]


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"sgl: {name:<18} {'ok' if ok else 'FAILED'}  {detail}", flush=True)
    return ok


def main() -> None:
    url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:30000"
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    results = []
    state = describe.run(name="add")
    results.append(check("gen", isinstance(state["body"], str), repr(state["body"])))
    results.append(check("select", state["kind"] in KINDS, repr(state["kind"])))
    number = state["number"]
    results.append(check("regex", re.fullmatch(r"[0-9]{1,3}", number) is not None, repr(number)))
    integer = state["integer"]
    results.append(
        check("dtype=int", re.fullmatch(r"[-+]?[0-9]+", integer.strip()) is not None, repr(integer))
    )
    results.append(
        check("gen(choices=)", state["mode"] in ["'r'", "'w'", "'rb'"], repr(state["mode"]))
    )
    try:
        config = json.loads(state["config"])
        valid = set(config) == {"name", "size", "ok"} and isinstance(config["ok"], bool)
    except ValueError:
        valid = False
    results.append(check("json_schema", valid, state["config"]))
    forked = branches.run()
    last_line = forked.text().split("\n")[-1]
    results.append(
        check("fork", last_line.startswith("# ") and " | " in last_line, repr(last_line))
    )
    batch = describe.run_batch([{"name": "mul"}, {"name": "join"}], num_threads=2)
    results.append(
        check("run_batch", all(b["kind"] in KINDS for b in batch), str([b["kind"] for b in batch]))
    )
    streamed = describe.run(name="read", stream=True)
    pieces = list(streamed.text_iter("body"))
    results.append(check("stream", "".join(pieces) == streamed["body"], f"{len(pieces)} pieces"))
    print(f"sgl: {sum(results)} of {len(results)} checks passed")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
