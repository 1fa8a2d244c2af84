# SPDX-License-Identifier: Apache-2.0
"""Benchmark result files and the page rendered from them: `docs/benchmarks.md` is exactly
what the committed files in `docs/benchmark_results/` render (nobody edits its numbers by
hand), every committed file says what reproduces and qualifies its figures, and the writer
records the command line and the machine."""

from __future__ import annotations

import json

import pytest
import torch

from scripts.bench import render, results

RESULTS_DIR = results.REPO_ROOT / results.DEFAULT_RESULTS_DIR
CPUINFO = """\
processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
"""


def test_committed_page_is_what_the_result_files_render():
    rendered = render.render(render.load_results(RESULTS_DIR), "benchmark_results")
    page = (results.REPO_ROOT / render.DEFAULT_OUTPUT).read_text()
    assert page == rendered, "docs/benchmarks.md is stale: run python -m scripts.bench.render"
    assert render.main(["--check"]) == 0


def test_committed_result_files_say_what_reproduces_them():
    files = render.load_results(RESULTS_DIR)
    assert files
    for stem, doc in files:
        assert doc["benchmark"] and doc["command"], stem
        assert "python -m " in doc["command"], stem
        assert doc["source"], stem
        assert {"cpu", "isa", "cores", "gpu"} <= set(doc["machine"]), stem
        assert doc["machine"]["cpu"] or doc["machine"]["gpu"], stem
        assert "torch" in doc and "commit" in doc and doc["date"], stem
        assert doc["figures"], stem
        for fig in doc["figures"]:
            assert fig["name"] and fig["value"] is not None and "unit" in fig, stem
        # a figure a run reports twice would make the standing ambiguous
        assert len({f["name"] for f in doc["figures"]}) == len(doc["figures"]), stem


def test_cpu_description_reads_model_and_notable_flags():
    model, isa = results.cpu_description(CPUINFO)
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert isa == ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert results.cpu_description("") == (None, [])


def test_writer_records_command_machine_and_figures(tmp_path):
    argv = ["--batch-size", "1", "16", "--server-args", "--port 1 --dtype float32"]
    command = results.command_line("bench_one_batch", argv)
    assert command == (
        "python -m scripts.bench_one_batch --batch-size 1 16 "
        "--server-args '--port 1 --dtype float32'"
    )
    doc = results.new_result(
        "bench_one_batch",
        command,
        [results.figure("NEXTN / plain decode tok/s, batch 1", 1.23456, "x")],
        [{"variant": "plain", "decode_throughput": 100.0}],
    )
    path = results.write_result(tmp_path, doc)
    again = results.write_result(tmp_path, doc)
    assert path != again  # a second run the same second gets its own file
    saved = json.loads(path.read_text())
    assert saved["command"] == command
    assert saved["source"] == results.MEASURED
    assert saved["torch"] == torch.__version__
    machine = saved["machine"]
    assert set(machine) == {"cpu", "isa", "cores", "gpu"}
    assert machine["cores"] >= 1 and machine["gpu"] is None
    assert set(machine["isa"]) <= set(results.NOTABLE_ISA_FLAGS)
    assert saved["figures"] == [
        {"name": "NEXTN / plain decode tok/s, batch 1", "value": 1.235, "unit": "x"}
    ]
    assert saved["records"] == [{"variant": "plain", "decode_throughput": 100.0}]
    # the commit is this checkout's HEAD (with -dirty when tracked files changed)
    assert saved["commit"] is None or len(saved["commit"].split("-")[0]) == 40
    page = render.render(render.load_results(tmp_path))
    assert command in page and render.device_label(machine) in page and "1.235x" in page


def test_standing_takes_each_figure_from_the_newest_run_of_its_device():
    machine = {"cpu": "Some CPU", "isa": ["avx2"], "cores": 4, "gpu": None}
    gpu = {"cpu": "Some CPU", "isa": ["avx2"], "cores": 4, "gpu": "Some GPU"}

    def doc(date, machine, figures):
        return {
            "benchmark": "bench_one_batch",
            "command": f"python -m scripts.bench_one_batch  # {date}",
            "date": date,
            "machine": machine,
            "torch": "2.13.0",
            "commit": None,
            "source": "measured",
            "figures": [results.figure(n, v, "x") for n, v in figures],
        }

    runs = [
        ("old", doc("2026-01-01", machine, [("a", 1.0), ("b", 2.0)])),
        ("new", doc("2026-02-01", machine, [("a", 1.5)])),
        ("gpu", doc("2026-03-01", gpu, [("a", 9.0)])),
    ]
    by_device = {
        render.device_label(m): [(f["name"], f["value"], stem) for _, f, stem in rows]
        for m, rows in (
            (machine, render.standing_rows(runs[:2])),
            (gpu, render.standing_rows(runs[2:])),
        )
    }
    assert by_device == {
        "Some CPU, 4 cores, AVX2": [("a", 1.5, "new"), ("b", 2.0, "old")],
        "Some GPU": [("a", 9.0, "gpu")],
    }
    page = render.render(runs)
    assert page.index("### Some GPU") < page.index("### Some CPU, 4 cores, AVX2")


def one_batch_row(variant: str, bs: int, decode: float, prefill: float, accept=None) -> dict:
    return {
        "variant": variant,
        "batch_size": bs,
        "input_len": 128,
        "output_len": 64,
        "decode_throughput": decode,
        "prefill_throughput": prefill,
        "accept_length": accept,
    }


def test_one_batch_figures_are_the_ratios_of_the_run():
    rows = [
        one_batch_row("plain", 1, 200.0, 2000.0),
        one_batch_row("NEXTN(steps=3)", 1, 300.0, 1600.0, 3.3),
    ]
    hf = [one_batch_row("HF", 1, 40.0, 1000.0)]
    figures = {
        f["name"]: f["value"]
        for f in results.one_batch_figures(rows, hf, ["plain", "NEXTN(steps=3)"])
    }
    assert figures == {
        "plain / HF decode tok/s, batch 1": 5.0,
        "plain / HF prefill tok/s, batch 1": 2.0,
        "NEXTN / HF decode tok/s, batch 1": 7.5,
        "NEXTN / HF prefill tok/s, batch 1": 1.6,
        "NEXTN / plain decode tok/s, batch 1": 1.5,
        "NEXTN accept length, batch 1": 3.3,
    }


def test_offline_and_serving_figures_name_each_variant_of_a_sweep():
    offline = results.offline_figures(
        [
            ("plain", {"output_throughput": 100.0, "accept_length": None}),
            ("NEXTN(steps=1)", {"output_throughput": 120.0, "accept_length": 1.8}),
            ("NEXTN(steps=2)", {"output_throughput": 90.0, "accept_length": 2.5}),
        ],
        {"output_throughput": 50.0},
    )
    values = {f["name"]: f["value"] for f in offline}
    assert values["NEXTN(steps=1) / plain output tok/s"] == 1.2
    assert values["NEXTN(steps=2) / HF (best batch) output tok/s"] == 1.8
    assert values["HF (best batch) output tok/s"] == 50.0
    serving = results.serving_figures(
        [
            {"output_throughput": 10.0, "accept_length": None},
            {"output_throughput": 40.0, "accept_length": None},
            {"output_throughput": 12.0, "accept_length": 2.4},
            {"output_throughput": 60.0, "accept_length": 2.4},
        ],
        [
            "plain cache-off",
            "plain cache-on",
            "NEXTN(steps=3) cache-off",
            "NEXTN(steps=3) cache-on",
        ],
    )
    values = {f["name"]: f["value"] for f in serving}
    assert values["plain cache on / off output tok/s"] == 4.0
    assert values["NEXTN cache on / off output tok/s"] == 5.0
    assert values["NEXTN cache-on output tok/s"] == 60.0


@pytest.mark.parametrize(
    "machine, label",
    [
        (
            {"cpu": "AMD EPYC", "isa": ["avx2", "avx512f", "avx512_bf16"], "cores": 2},
            "AMD EPYC, 2 cores, AVX2, AVX-512, AVX512-BF16, no AMX",
        ),
        (
            {"cpu": "Intel Xeon", "isa": ["avx512f", "amx_tile", "amx_bf16"], "cores": 2},
            "Intel Xeon, 2 cores, AVX-512, AMX-BF16",
        ),
        ({"cpu": None, "isa": [], "cores": None, "gpu": "NVIDIA H200"}, "NVIDIA H200"),
    ],
)
def test_device_label(machine, label):
    assert render.device_label(machine) == label
