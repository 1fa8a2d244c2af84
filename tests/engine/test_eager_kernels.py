# SPDX-License-Identifier: Apache-2.0
"""An engine that captures no step (`--disable-cuda-graph`) still loads the project's C++ CPU
kernels when its runners are built, so its eager prefill and decode steps use them; with
`NEXTN_DISABLE_CPU_KERNELS=1` they stay unloaded and every step runs torch's forms. Both
give plain decoding's and NEXTN's greedy tokens alike (the torch forms are the oracle). Each
case runs in a fresh interpreter, since a loaded extension stays loaded for the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from runtime.configs.capture import default_cache_dir
from runtime.kernels import cpu_extension
from runtime.kernels.cpu_extension import DISABLE_ENV
from tests.engine.test_nextn import make_prompts

PROBE = r"""
import json, sys
from runtime import Engine
from runtime.kernels import cpu_extension
path, spec, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kw = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3} if spec == "nextn" else {}
engine = Engine(model_path=path, dtype="float32", disable_cuda_graph=True, **kw)
loaded_at_start = cpu_extension.available()
params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
outs = engine.generate(input_ids=prompts, sampling_params=params)
print(json.dumps({"loaded": loaded_at_start, "ids": [o["output_ids"] for o in outs]}))
"""


def probe(checkpoint, spec: str, prompts, kernels: bool) -> dict:
    env = dict(os.environ)
    env.pop(DISABLE_ENV, None)
    if not kernels:
        env[DISABLE_ENV] = "1"
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(checkpoint), spec, json.dumps(prompts)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_engine_without_captured_steps_runs_the_cpu_kernels_with_the_same_tokens(checkpoint):
    if os.environ.get(DISABLE_ENV) or not cpu_extension.load(default_cache_dir()):
        pytest.skip("the C++ kernels cannot be built here")
    prompts = make_prompts(3, seed=5, low=20, high=60)
    for spec in ("plain", "nextn"):
        torch_forms = probe(checkpoint, spec, prompts, kernels=False)
        kernels = probe(checkpoint, spec, prompts, kernels=True)
        assert not torch_forms["loaded"]
        assert kernels["loaded"]
        assert kernels["ids"] == torch_forms["ids"]
