# SPDX-License-Identifier: Apache-2.0
"""What the three benchmarks share, one module per job: `flags` (the command-line flags,
with the engine's defaults from `EngineConfig`), `variants` (plain / NEXTN and the engine of
each), `datasets` (every prompt source), `hf_baseline` (transformers `generate` on the same
inputs), `report` (SGLang's printed layout, ratios, JSONL records, plots), `overhead` (time
outside the model forwards), `serving_client` (requests over HTTP and their timing),
`launched_server` (a server process per variant), `results` (a run's result file) and
`render` (docs/benchmarks.md from the result files)."""
