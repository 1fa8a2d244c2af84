# SPDX-License-Identifier: Apache-2.0
"""`EngineConfig` is the one home of every engine setting: `ServerArgs` and the
command-line flags take its defaults, its checks are the server's checks."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from runtime.configs.capture import DISABLE_ENV
from runtime.configs.engine_config import EngineConfig, default_model_path
from runtime.server_args import ServerArgs

ENGINE_FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]


def test_server_args_reuse_every_engine_field_and_default():
    server_fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    for f in dataclasses.fields(EngineConfig):
        assert server_fields[f.name].default == f.default, f.name
    assert set(server_fields) - set(ENGINE_FIELDS) == {
        "host",
        "port",
        "api_key",
        "enable_metrics",
        "log_level",
        "served_model_name",
        "max_body_size",
        "graceful_shutdown_timeout",
    }


def test_flag_defaults_are_the_dataclass_defaults():
    parsed = ServerArgs.parser().parse_args([])
    assert ServerArgs.from_cli_args(parsed) == ServerArgs()
    assert vars(parsed) == dataclasses.asdict(ServerArgs())


def test_sglang_like_defaults_written_once():
    config = EngineConfig().resolve()
    assert config.model_path == default_model_path()
    assert (config.chunked_prefill_size, config.max_total_tokens, config.page_size) == (
        2048,
        65536,
        1,
    )
    assert config.max_running_requests == 64
    spec = EngineConfig(speculative_algorithm="mtp").resolve()
    assert spec.max_running_requests == 48
    assert (spec.speculative_algorithm, spec.speculative_num_steps) == ("NEXTN", 3)
    assert (spec.speculative_eagle_topk, spec.speculative_num_draft_tokens) == (1, 4)
    explicit = EngineConfig(speculative_algorithm="NEXTN", max_running_requests=7).resolve()
    assert explicit.max_running_requests == 7
    # the prefix cache is on, with snapshots every 256 prefill tokens, two per request slot
    assert not config.disable_radix_cache and config.radix_snapshot_interval == 256
    assert (config.radix_snapshot_slots, explicit.radix_snapshot_slots) == (128, 14)
    off = ServerArgs.from_cli(["--disable-radix-cache", "--radix-snapshot-slots", "3"])
    assert off.engine_config().disable_radix_cache and off.radix_snapshot_slots == 3


def test_server_args_hand_the_engine_exactly_its_settings():
    args = ServerArgs.from_cli(["--page-size", "4", "--port", "1234", "--dtype", "float32"])
    config = args.engine_config()
    assert type(config) is EngineConfig
    assert config == EngineConfig(page_size=4, dtype="float32").resolve()


@pytest.mark.parametrize(
    "overrides,error,message",
    [
        ({"page_size": 0}, ValueError, "--page-size must be >= 1"),
        ({"chunked_prefill_size": 0}, ValueError, "--chunked-prefill-size"),
        ({"dtype": "int4"}, ValueError, "--dtype 'int4' is not supported"),
        ({"max_running_requests": 0}, ValueError, "--max-running-requests"),
        ({"max_total_tokens": 2, "page_size": 4}, ValueError, "--max-total-tokens"),
        ({"context_length": 1}, ValueError, "--context-length"),
        ({"speculative_num_steps": 2}, ValueError, "need --speculative-algorithm"),
        ({"speculative_disable_by_batch_size": 4}, ValueError, "need --speculative-algorithm"),
        (
            {"speculative_algorithm": "NEXTN", "speculative_disable_by_batch_size": 0},
            ValueError,
            "--speculative-disable-by-batch-size must be a batch size >= 1",
        ),
        ({"speculative_token_map": "freq.pt"}, ValueError, "need --speculative-algorithm"),
        (
            {"speculative_algorithm": "NEXTN", "speculative_token_map": "/no/such/freq.pt"},
            ValueError,
            "--speculative-token-map '/no/such/freq.pt' does not exist",
        ),
        ({"radix_snapshot_interval": -1}, ValueError, "--radix-snapshot-interval"),
        ({"radix_snapshot_slots": 0}, ValueError, "--radix-snapshot-slots"),
        ({"model_path": "/no/such/model"}, FileNotFoundError, "does not exist"),
    ],
)
def test_bad_settings_are_refused_with_the_flag_to_fix(overrides, error, message):
    with pytest.raises(error, match=message):
        EngineConfig(**overrides).resolve()


def test_off_switches_and_aliases_pass():
    for chunk in (None, -1, 1):
        EngineConfig(chunked_prefill_size=chunk).resolve()
    EngineConfig(dtype="bf16").resolve()


def test_a_script_can_take_a_subset_of_the_flags():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    EngineConfig.add_cli_args(parser, names=("model_path", "dtype", "chunked_prefill_size"))
    ns = parser.parse_args(["--model", "/ckpt", "--chunked-prefill-size", "-1"])
    config = EngineConfig.from_cli_args(ns, dtype="float32")
    assert (config.model_path, config.dtype, config.chunked_prefill_size) == (
        "/ckpt",
        "float32",
        -1,
    )
    assert config.max_total_tokens == EngineConfig().max_total_tokens
    with pytest.raises(SystemExit):
        parser.parse_args(["--page-size", "4"])  # not asked for


def test_capture_flags_and_why_steps_run_eagerly(monkeypatch):
    """Captured steps are on by default (SGLang's --disable-cuda-graph turns them off), the
    bucket flags reach the CaptureConfig, and a multi-rank replica captures too, compiling
    in the serving thread (its ranks compile each step together) even when asked for the
    background."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    config = EngineConfig(cuda_graph_bs=[1, 4], capture_compile="inline").resolve()
    assert config.capture_off_reason() is None
    capture = config.capture_config()
    assert capture.enabled and not capture.background and capture.buckets(8) == (1, 4)
    assert EngineConfig(cuda_graph_max_bs=6).capture_config().buckets(64) == (1, 2, 4, 6)
    # a listed size above the largest batch gives way to that batch size (SGLang adds its
    # request limit), so every batch the engine can run has a bucket
    listed = EngineConfig(cuda_graph_bs=[1, 4, 16, 64], speculative_algorithm="NEXTN").resolve()
    assert listed.max_running_requests == 48
    assert listed.capture_config().buckets(listed.max_running_requests) == (1, 4, 16, 48)
    capped = EngineConfig(cuda_graph_bs=[1, 4, 16, 64], cuda_graph_max_bs=8).capture_config()
    assert capped.buckets(64) == (1, 4, 8)
    assert EngineConfig(cuda_graph_bs=[1, 2]).capture_config().buckets(64) == (1, 2)
    off = EngineConfig(disable_cuda_graph=True)
    assert not off.capture_config().enabled and off.capture_off_reason() == "--disable-cuda-graph"
    assert EngineConfig().resolve().capture_config().background  # the default mode
    for parallel in ({"tp_size": 2}, {"ep_size": 2}, {"tp_size": 2, "ep_size": 2}):
        replica = EngineConfig(**parallel).resolve()
        assert replica.capture_off_reason() is None
        assert replica.capture_config().enabled and not replica.capture_config().background
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert not config.capture_config().enabled and DISABLE_ENV in config.capture_off_reason()


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"capture_compile": "lazy"}, "--capture-compile must be one of background, inline"),
        ({"cuda_graph_max_bs": 0}, "--cuda-graph-max-bs must be >= 1"),
        ({"cuda_graph_bs": [4, 0]}, "--cuda-graph-bs sizes must be >= 1"),
    ],
)
def test_bad_capture_flags_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides).resolve()


def test_benchmark_flags_are_the_engines_own():
    """The benchmarks' speculative flags come from `EngineConfig` (names, types, help), so the
    default they quote is the one `SpeculativeConfig` resolves to."""
    from scripts.bench import flags

    parser = argparse.ArgumentParser()
    flags.add_model_args(parser)
    actions = {a.dest: a for a in parser._actions}
    for name in (
        "dtype",
        "speculative_algorithm",
        "speculative_num_steps",
        "speculative_eagle_topk",
        "speculative_num_draft_tokens",
        "speculative_disable_by_batch_size",
        "speculative_token_map",
    ):
        names, options = EngineConfig.cli_argument(name)
        action = actions[name]
        assert action.option_strings == names and action.type is options.get("type")
        assert action.help.startswith(options["help"]), name
    assert flags.ENGINE_DEFAULTS["dtype"] == actions["dtype"].default
    resolved = EngineConfig(speculative_algorithm="NEXTN").resolve()
    assert f"default {resolved.speculative_num_steps})" in actions["speculative_num_steps"].help
    assert actions["speculative_eagle_topk"].help.startswith(str(resolved.speculative_eagle_topk))


def test_docs_quote_the_speculative_default():
    """The one prose restatement of the default steps (docs/architecture.md) matches it."""
    import re
    from pathlib import Path

    from runtime.configs.speculative import DEFAULT_NUM_STEPS

    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    quoted = re.findall(r"`--speculative-num-steps`, default (\d+)", text)
    assert quoted == [str(DEFAULT_NUM_STEPS)]
