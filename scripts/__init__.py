# SPDX-License-Identifier: Apache-2.0
"""Command-line tools of nextn-runtime: the benchmarks, the benchmark prompt file and the
token maps. Run them from the repository root as modules, e.g.
`python -m scripts.bench_one_batch --help`; `scripts.bench` holds what they share. The
tiny-model trainer is the `training` package beside this one."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
