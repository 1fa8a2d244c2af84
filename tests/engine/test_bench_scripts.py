# SPDX-License-Identifier: Apache-2.0
"""The benchmark scripts run end to end on a tiny random DeepSeek-V4 + MTP checkpoint and
report numbers that add up: token totals match the requests (ignore_eos), throughputs are
tokens over duration, and every printed ratio is the ratio of the two throughputs printed
in the same run."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime.engine.tokenizer import load_tokenizer
from runtime.layers import hyper_connection
from scripts import REPO_ROOT
from scripts.bench import datasets, hf_baseline
from tests.server_process import ServerProcess
from tests.tiny_checkpoints import build_tiny_v4_mtp_checkpoint, save_char_tokenizer
from training.corpus import split_by_file, stdlib_sources


def script(name: str):
    """The tool `python -m scripts.<name>` runs, as a module."""
    return importlib.import_module(f"scripts.{name}")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_ckpt")
    build_tiny_v4_mtp_checkpoint(path, seed=7)
    save_char_tokenizer(path, 97)
    return path


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The scripts pin torch's threads; give the rest of the session its setting back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def blocks(text: str, title: str) -> list[dict[str, str]]:
    """Rows ('Label:' -> value) of every printed result block with `title`."""
    out = []
    for chunk in text.split(f" {title} ")[1:]:
        rows = {}
        for line in chunk.splitlines()[1:]:
            if line.startswith("=" * 10):
                break
            match = re.match(r"^(.+?:)\s+(\S.*?)\s*$", line)
            if match:
                rows[match.group(1)] = match.group(2)
        out.append(rows)
    return out


def ratios(text: str) -> dict[str, float]:
    """Printed ratio lines, 'label: 1.234x' -> 1.234."""
    pattern = re.compile(r"^(.+): ([\d.]+|nan)x$", re.M)
    return {m.group(1): float(m.group(2)) for m in pattern.finditer(text)}


def close(a: float, b: float, rel: float = 2e-3, abs_: float = 6e-3) -> bool:
    return abs(a - b) <= max(abs_, rel * abs(b))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


COMMON = ["--dtype", "float32", "--threads", "1", "--disable-tqdm"]


# --------------------------------------------------------------------------------------
# bench_one_batch


def test_one_batch_compare_profile_plot(ckpt, tmp_path, capsys):
    jsonl, png = tmp_path / "one.jsonl", tmp_path / "one.png"
    out = script("bench_one_batch").main(
        [
            "--model-path",
            str(ckpt),
            *COMMON,
            "--compare",
            "--batch-size",
            "1",
            "2",
            "--input-len",
            "6",
            "--output-len",
            "4",
            "--profile-overhead",
            "--profile-top",
            "5",
            "--result-filename",
            str(jsonl),
            "--plot",
            str(png),
            "--results-dir",
            str(tmp_path / "results"),
        ]
    )
    text = capsys.readouterr().out
    rows = {(r["variant"], r["batch_size"]): r for r in out["rows"]}
    assert set(rows) == {(v, b) for v in ("plain", "NEXTN(steps=3)") for b in (1, 2)}
    for (variant, bs), r in rows.items():
        assert r["generated_tokens"] == bs * 4 and len(r["output_ids"]) == bs
        decode = r["total_latency"] - r["prefill_latency"]
        assert close(r["decode_throughput"], bs * 3 / decode)
        assert close(r["overall_throughput"], bs * (6 + 4) / r["total_latency"])
        assert close(r["decode_latency_per_token"], decode / 3)
        assert (r["accept_length"] is None) == (variant == "plain")
        if r["accept_length"] is not None:
            assert 1.0 <= r["accept_length"] <= 4.0
    # same prompts, same greedy tokens: both variants did the same work
    assert rows[("plain", 2)]["output_ids"] == rows[("NEXTN(steps=3)", 2)]["output_ids"]
    assert all(r["compiled_during_run"] == [] for r in rows.values())  # eager engines
    for line in (
        "Prefill. latency:",
        "Decode 0. Batch size: 2",
        "Decode.  slowest step:",
        "Decode.  median latency:",
        "Total. latency:",
        "One Batch Benchmark Result",
    ):
        assert line in text
    printed = ratios(text)
    for bs in (1, 2):
        label = f"NEXTN(steps=3)/plain decode tok/s [bs={bs} in=6 out=4]"
        expected = (
            rows[("NEXTN(steps=3)", bs)]["decode_throughput"]
            / rows[("plain", bs)]["decode_throughput"]
        )
        assert close(printed[label], expected, abs_=1e-3)
    # overhead: the forwards and the rest add up to the decode wall time
    assert len(out["overhead"]) == 2 and text.count("of decode wall time (scheduling") == 2
    for report in out["overhead"]:
        total = report["engine_overhead_share"] + sum(report["forward_share"].values())
        assert 0.0 < report["engine_overhead_share"] < 1.0 and close(total, 1.0, abs_=1e-9)
    assert set(out["overhead"][1]["forward_share"]) == {"target", "draft"}
    assert all(r["compiled_code_share"] == 0.0 for r in out["overhead"])  # eager engines
    assert "ncalls" in text and "cumtime" in text
    records = read_jsonl(jsonl)
    assert len(records) == 6 and sum(r.get("kind") == "overhead" for r in records) == 2
    assert {
        "prefill_latency",
        "median_decode_latency",
        "overall_throughput",
        "accept_length",
        "threads",
        "dtype",
    } <= set(records[0])
    if importlib.util.find_spec("matplotlib"):
        assert png.stat().st_size > 0
    # the result file: the command that ran, the machine, and the run's printed ratios
    (result_file,) = (tmp_path / "results").glob("*_bench_one_batch.json")
    result = json.loads(result_file.read_text())
    assert result["command"].startswith("python -m scripts.bench_one_batch --model-path ")
    assert "--batch-size 1 2 --input-len 6 --output-len 4" in result["command"]
    assert {"cpu", "isa", "cores", "gpu"} <= set(result["machine"])
    assert len(result["records"]) == 6
    figures = {f["name"]: f["value"] for f in result["figures"]}
    for bs in (1, 2):
        label = f"NEXTN(steps=3)/plain decode tok/s [bs={bs} in=6 out=4]"
        assert close(figures[f"NEXTN / plain decode tok/s, batch {bs}"], printed[label])


def test_one_batch_hf_baseline(ckpt, capsys):
    out = script("bench_one_batch").main(
        [
            "--model-path",
            str(ckpt),
            *COMMON,
            "--batch-size",
            "2",
            "--input-len",
            "6",
            "--output-len",
            "4",
            "--hf-baseline",
        ]
    )
    text = capsys.readouterr().out
    ours, hf = out["rows"][0], out["hf_rows"][0]
    assert hf["generated_tokens"] == ours["generated_tokens"] == 8
    assert hf["same_greedy_tokens_as_ours"] == "2/2"  # same inputs, dtype and token count
    printed = ratios(text)
    tag = "[bs=2 in=6 out=4]"
    assert close(
        printed[f"ours[plain]/HF decode tok/s {tag}"],
        ours["decode_throughput"] / hf["decode_throughput"],
        abs_=1e-3,
    )
    assert close(
        printed[f"ours[plain]/HF overall tok/s {tag}"],
        ours["overall_throughput"] / hf["overall_throughput"],
        abs_=1e-3,
    )


def test_one_batch_prompt_file(ckpt, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "def fib(n):"}\nhi\nreturn a + b\n')
    bench = script("bench_one_batch")
    file_prompts = datasets.tokenized_prompt_file(str(data), str(ckpt))
    batch = datasets.batch_prompts(0, 3, 6, 97, file_prompts)
    texts = {"def fi", "return"}  # "hi" is shorter than input-len, so never used
    tokenizer = load_tokenizer(ckpt, required=True)
    decoded = {tokenizer.decode(ids) for ids in batch}
    assert decoded == texts and all(len(ids) == 6 for ids in batch)
    out = bench.main(
        ["--model-path", str(ckpt), *COMMON, "--batch-size", "3", "--input-len", "6"]
        + ["--output-len", "4", "--dataset-path", str(data), "--hf-baseline"]
    )
    assert out["hf_rows"][0]["same_greedy_tokens_as_ours"] == "3/3"  # HF saw the same prompts
    assert out["rows"][0]["generated_tokens"] == 12
    with pytest.raises(SystemExit):
        bench.main(
            ["--model-path", str(ckpt), *COMMON, "--input-len", "99"]
            + ["--dataset-path", str(data)]
        )
    assert "no prompt of --dataset-path has 99 tokens" in capsys.readouterr().err


def test_code_prompts_come_from_held_out_files(tmp_path):
    train, held = split_by_file(stdlib_sources(), 20)
    prompts = datasets.code_prompts(8, 400, 20)
    assert len(prompts) == 8 and all(0 < len(p) <= 400 for p in prompts)
    held_texts = [text for _, text in held]
    assert all(any(text.startswith(p) for text in held_texts) for p in prompts)
    assert not any(text.startswith(p) for p in prompts for _, text in train)
    # the tool as a user runs it, from the repository root: the same prompts, one a line
    out = tmp_path / "prompts.jsonl"
    command = ["-m", "scripts.make_code_prompts", "--num-prompts", "8", "--prompt-chars", "400"]
    subprocess.run([sys.executable, *command, "-o", str(out)], cwd=REPO_ROOT, check=True)
    assert [r["prompt"] for r in read_jsonl(out)] == prompts


def test_bad_flags_fail_before_loading(capsys):
    with pytest.raises(SystemExit) as err:
        script("bench_one_batch").main(
            ["--speculative-num-steps", "2", "--model-path", "/nonexistent"]
        )
    assert err.value.code == 2 and "needs --speculative-algorithm" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        script("bench_serving").main(["--compare"])
    assert err.value.code == 2


def test_capture_stats_reports_every_captured_step_as_one_graph(ckpt, capsys, monkeypatch):
    """`scripts.capture_stats`: each step a plain decode or a NEXTN round replays (the
    prefill stays eager) traces to one graph, reported with its operator count; the
    one-layer draft's steps are far smaller than the target's."""
    monkeypatch.setattr(
        hyper_connection, "COMPILE_HC_PRE_ONCE", hyper_connection.COMPILE_HC_PRE_ONCE
    )
    argv = ["--model-path", str(ckpt), "--batch-size", "2", "--speculative-num-steps", "2"]
    script("capture_stats").main(argv)
    lines = capsys.readouterr().out.splitlines()
    counts = {}
    for line in lines:
        match = re.fullmatch(r"(bs 2: .+): (\d+) operators, one graph", line)
        assert match, line
        counts[match.group(1)] = int(match.group(2))
    assert set(counts) == {
        "bs 2: target decode 1 row(s)/request",
        "bs 2: target target_verify 3 row(s)/request",
        "bs 2: draft draft_extend 3 row(s)/request",
        "bs 2: draft decode (chained) 1 row(s)/request",
    }
    draft = max(v for k, v in counts.items() if "draft" in k.split(":")[1])
    assert 0 < 2 * draft < min(v for k, v in counts.items() if "target" in k)


# --------------------------------------------------------------------------------------
# bench_offline_throughput


def check_offline_block(rows: dict[str, str], record: dict) -> None:
    """The printed block and the JSONL record agree, and throughput = tokens / duration."""
    duration = record["total_latency"]
    assert int(rows["Total generated tokens:"]) == record["total_output_tokens"]
    assert int(rows["Total input tokens:"]) == record["total_input_tokens"]
    assert close(record["output_throughput"], record["total_output_tokens"] / duration, abs_=1e-9)
    assert close(
        record["total_throughput"],
        (record["total_input_tokens"] + record["total_output_tokens"]) / duration,
        abs_=1e-9,
    )
    assert close(record["request_throughput"], record["successful_requests"] / duration, abs_=1e-9)
    assert close(float(rows["Output token throughput (tok/s):"]), record["output_throughput"])


@pytest.mark.parametrize(("limit", "plain_share"), [(None, 0.0), ("1", 1.0)])
def test_offline_nextn(ckpt, tmp_path, capsys, limit, plain_share):
    """NEXTN offline; with speculation off from batch size 1 every token is decoded
    plainly, and the result says so."""
    jsonl = tmp_path / "offline.jsonl"
    script("bench_offline_throughput").main(
        [
            "--model-path",
            str(ckpt),
            *COMMON,
            *(["--speculative-disable-by-batch-size", limit] if limit else []),
            "--speculative-algorithm",
            "NEXTN",
            "--num-prompts",
            "5",
            "--random-input-len",
            "10",
            "--random-output-len",
            "6",
            "--random-range-ratio",
            "1",
            "--result-filename",
            str(jsonl),
        ]
    )
    text = capsys.readouterr().out
    (rows,) = blocks(text, "Offline Throughput Benchmark Result")
    (record,) = read_jsonl(jsonl)
    assert rows["Backend:"] == "engine" and rows["Successful requests:"] == "5"
    assert record["total_output_tokens"] == 5 * 6 and record["total_input_tokens"] == 5 * 10
    check_offline_block(rows, record)
    assert record["plain_decode_share"] == plain_share
    assert float(rows["Tokens decoded plainly:"]) == plain_share
    if plain_share < 1:
        assert 1.0 <= float(rows["Accept length:"]) <= 4.0 and record["accept_length"] >= 1.0


def test_offline_compare_with_hf_and_plot(ckpt, tmp_path, capsys):
    jsonl, png = tmp_path / "offline.jsonl", tmp_path / "steps.png"
    out = script("bench_offline_throughput").main(
        [
            "--model-path",
            str(ckpt),
            *COMMON,
            "--compare",
            "--speculative-num-steps",
            "1",
            "2",
            "--num-prompts",
            "6",
            "--random-input-len",
            "12",
            "--random-output-len",
            "6",
            "--random-range-ratio",
            "0.5",
            "--hf-baseline",
            "--hf-batch-sizes",
            "1",
            "4",
            "--result-filename",
            str(jsonl),
            "--plot",
            str(png),
            "--results-dir",
            str(tmp_path),
        ]
    )
    text = capsys.readouterr().out
    expected_out = sum(n for _, n in out["dataset"])
    expected_in = sum(len(ids) for ids, _ in out["dataset"])
    printed = blocks(text, "Offline Throughput Benchmark Result")
    records = read_jsonl(jsonl)
    assert [r["variant"] for r in records] == ["plain", "NEXTN(steps=1)", "NEXTN(steps=2)", "HF"]
    for rows, record in zip(printed, records, strict=True):
        assert record["total_output_tokens"] == expected_out
        assert record["total_input_tokens"] == expected_in
        check_offline_block(rows, record)
    plain, hf = records[0], records[3]
    got = ratios(text)
    for record in records[1:3]:
        v = record["variant"]
        assert close(
            got[f"{v}/plain output token throughput"],
            record["output_throughput"] / plain["output_throughput"],
            abs_=1e-3,
        )
        assert close(
            got[f"ours[{v}]/HF output tok/s"],
            record["output_throughput"] / hf["output_throughput"],
            abs_=1e-3,
        )
    assert hf["hf_batch_size"] in (1, 4)
    if importlib.util.find_spec("matplotlib"):
        assert png.stat().st_size > 0
    (result_file,) = tmp_path.glob("*_bench_offline_throughput.json")
    result = json.loads(result_file.read_text())
    assert "--speculative-num-steps 1 2 --num-prompts 6" in result["command"]
    assert [r["variant"] for r in result["records"]] == [r["variant"] for r in records]
    figures = {f["name"]: f["value"] for f in result["figures"]}
    for record in records[1:3]:
        v = record["variant"]
        assert close(
            figures[f"{v} / plain output tok/s"], got[f"{v}/plain output token throughput"]
        )
        assert close(
            figures[f"{v} / HF (best batch) output tok/s"], got[f"ours[{v}]/HF output tok/s"]
        )


def test_offline_repeats_take_turns_and_report_the_median_run(ckpt, tmp_path, capsys):
    """`--repeats 3`: both variants run the dataset three times, taking turns (each turn
    prefills every prompt again), and each reports its run of median throughput."""
    jsonl = tmp_path / "offline.jsonl"
    script("bench_offline_throughput").main(
        [
            "--model-path",
            str(ckpt),
            *COMMON,
            "--compare",
            "--speculative-num-steps",
            "2",
            "--repeats",
            "3",
            "--num-prompts",
            "4",
            "--random-input-len",
            "10",
            "--random-output-len",
            "5",
            "--random-range-ratio",
            "1",
            "--result-filename",
            str(jsonl),
        ]
    )
    text = capsys.readouterr().out
    turns = re.findall(r"^turn (\d)/3 (\S+): ([\d.]+) output tok/s", text, re.MULTILINE)
    labels = ["plain", "NEXTN(steps=2)"]
    assert [(int(t), label) for t, label, _ in turns] == [
        (t, label) for t in (1, 2, 3) for label in labels
    ]
    records = read_jsonl(jsonl)
    assert [r["variant"] for r in records] == labels
    for record, rows in zip(records, blocks(text, "Offline Throughput Benchmark Result")):
        runs = sorted(float(x) for _, label, x in turns if label == record["variant"])
        assert close(record["output_throughput"], runs[1], abs_=0.01)
        assert record["total_output_tokens"] == 4 * 5
        check_offline_block(rows, record)
    assert records[1]["accept_length"] >= 1.0


def test_offline_prompt_file(ckpt, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "def fib(n):", "output_len": 3}\n{"prompt": "hello"}\nplain line\n')
    jsonl = tmp_path / "offline.jsonl"
    script("bench_offline_throughput").main(
        [
            "--model-path",
            str(ckpt),
            *COMMON,
            "--dataset-path",
            str(data),
            "--num-prompts",
            "10",
            "--random-output-len",
            "5",
            "--result-filename",
            str(jsonl),
        ]
    )
    (record,) = read_jsonl(jsonl)
    assert record["successful_requests"] == 3 and record["total_output_tokens"] == 3 + 5 + 5
    assert record["total_input_tokens"] == len("def fib(n):") + len("hello") + len("plain line")
    (rows,) = blocks(capsys.readouterr().out, "Offline Throughput Benchmark Result")
    check_offline_block(rows, record)


# --------------------------------------------------------------------------------------
# bench_serving


@pytest.fixture(scope="module")
def nextn_server(ckpt, tmp_path_factory):
    """A NEXTN server on a free loopback port; yields its base URL."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = ServerProcess(
        "--model-path",
        str(ckpt),
        "--dtype",
        "float32",
        "--log-level",
        "warning",
        "--speculative-algorithm",
        "NEXTN",
        log_path=log,
    )
    try:
        yield server.url
    finally:
        server.stop()


def check_serving(text: str, record: dict, num: int, output_len: int) -> dict[str, str]:
    (rows,) = blocks(text, "Serving Benchmark Result")
    duration = record["duration"]
    assert int(rows["Successful requests:"]) == record["completed"] == num
    assert int(rows["Total generated tokens:"]) == record["total_output_tokens"] == num * output_len
    assert int(rows["Total input tokens:"]) == record["total_input_tokens"] > 0
    assert close(record["output_throughput"], record["total_output_tokens"] / duration, abs_=1e-9)
    assert close(
        record["total_throughput"],
        (record["total_input_tokens"] + record["total_output_tokens"]) / duration,
        abs_=1e-9,
    )
    assert close(float(rows["Output token throughput (tok/s):"]), record["output_throughput"])
    keys = ("mean_ttft_ms", "median_itl_ms", "p99_tpot_ms", "mean_e2e_latency_ms", "concurrency")
    for key in keys:
        assert key in record and record[key] >= 0
    assert record["mean_ttft_ms"] <= record["mean_e2e_latency_ms"]
    for label in (
        "Mean TTFT (ms):",
        "P99 ITL (ms):",
        "Median TPOT (ms):",
        "Mean E2E Latency (ms):",
        "Concurrency:",
        "Traffic request rate:",
        "Max request concurrency:",
    ):
        assert label in rows
    return rows


@pytest.mark.parametrize(
    "backend,extra",
    [
        ("sglang", ["--request-rate", "50", "--max-concurrency", "2"]),
        ("sglang", ["--disable-stream"]),
        ("sglang-oai", []),
        ("sglang-oai-chat", []),
    ],
)
def test_serving_against_a_running_server(nextn_server, ckpt, backend, extra, tmp_path, capsys):
    jsonl = tmp_path / "serving.jsonl"
    script("bench_serving").main(
        [
            "--base-url",
            nextn_server,
            # the server names its model rather than showing its path: the client brings
            # the tokenizer, as with SGLang's bench_serving
            "--tokenizer",
            str(ckpt),
            "--backend",
            backend,
            "--num-prompts",
            "4",
            "--random-input-len",
            "12",
            "--random-output-len",
            "5",
            "--random-range-ratio",
            "1",
            "--output-file",
            str(jsonl),
            "--disable-tqdm",
            *extra,
        ]
    )
    (record,) = read_jsonl(jsonl)
    rows = check_serving(capsys.readouterr().out, record, 4, 5)
    assert rows["Backend:"] == backend
    assert 1.0 <= record["accept_length"] <= 4.0 and "Accept length:" in rows
    if backend == "sglang":
        assert record["total_input_tokens"] == 4 * 12  # input_ids are sent as they are
    if "--disable-stream" in extra:
        assert close(record["mean_ttft_ms"], record["mean_e2e_latency_ms"], abs_=1e-6)


def launched_comparison(ckpt, jsonl, *extra: str) -> list[dict]:
    """`bench_serving --launch-server --compare` over 3 short prompts."""
    return script("bench_serving").main(
        ["--launch-server", "--compare", *extra, "--model-path", str(ckpt), *COMMON]
        + ["--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4"]
        + ["--random-range-ratio", "1", "--output-file", str(jsonl)]
    )


def test_serving_launch_server_compare(ckpt, tmp_path, capsys):
    jsonl = tmp_path / "serving.jsonl"
    launched_comparison(ckpt, jsonl)
    text = capsys.readouterr().out
    plain, nextn = read_jsonl(jsonl)
    assert (plain["variant"], nextn["variant"]) == ("plain", "NEXTN(steps=3)")
    assert plain["accept_length"] is None and nextn["accept_length"] >= 1.0
    assert text.count("launching:") == 2
    for record, rows in zip((plain, nextn), blocks(text, "Serving Benchmark Result"), strict=True):
        assert int(rows["Total generated tokens:"]) == record["total_output_tokens"] == 3 * 4
        assert close(float(rows["Output token throughput (tok/s):"]), record["output_throughput"])
    got = ratios(text)["NEXTN(steps=3)/plain output token throughput"]
    assert close(got, nextn["output_throughput"] / plain["output_throughput"], abs_=1e-3)


def test_serving_repeats_run_the_servers_side_by_side_in_turns(ckpt, tmp_path, capsys):
    """`--repeats 2`: both servers start first, then each runs the prompts twice, taking
    turns (its prefix cache flushed before each run), and the ratios come from each
    variant's run of median throughput (the lower of two)."""
    jsonl = tmp_path / "serving.jsonl"
    records = launched_comparison(ckpt, jsonl, "--repeats", "2")
    text = capsys.readouterr().out
    runs = read_jsonl(jsonl)
    labels = ["plain", "NEXTN(steps=3)"]
    assert [r["variant"] for r in runs] == labels * 2
    assert text.count("launching:") == 2 and text.index("launching:", 1) < text.index("turn 1/2")
    turns = re.findall(r"^turn (\d)/2 (\S+): ([\d.]+) output tok/s", text, re.MULTILINE)
    assert [(int(t), label) for t, label, _ in turns] == [(t, v) for t in (1, 2) for v in labels]
    for label, record in zip(labels, records, strict=True):
        mine = [r for r in runs if r["variant"] == label]
        assert record == min(mine, key=lambda r: r["output_throughput"])
        assert all(r["total_output_tokens"] == 3 * 4 for r in mine)
    got = ratios(text)["NEXTN(steps=3)/plain output token throughput"]
    expected = records[1]["output_throughput"] / records[0]["output_throughput"]
    assert close(got, expected, abs_=1e-3)


def test_multiturn_conversations_resend_their_history():
    convs = datasets.multiturn_conversations(3, 2, 3, 10, 4, 5, 1.0, vocab_size=50)
    assert convs[0].system == convs[1].system and len(convs[0].system) == 10
    assert [len(u) for u in convs[0].users] == [4, 4, 4] and convs[0].output_lens == [5, 5, 5]
    answers = [[1] * 5, [2] * 5]
    assert convs[1].prompt(0, []) == convs[1].system + convs[1].users[0]
    assert (
        convs[1].prompt(2, answers)
        == (convs[1].system + convs[1].users[0] + answers[0] + convs[1].users[1] + answers[1])
        + convs[1].users[2]
    )


def test_serving_multiturn_against_a_running_server(nextn_server, tmp_path, capsys):
    """Turn k+1 resends turns 1..k: the server's prefix cache serves them (its
    `cached_tokens`), and the result reports the hit rate and TTFT by turn."""
    jsonl = tmp_path / "serving.jsonl"
    script("bench_serving").main(
        [
            "--base-url",
            nextn_server,
            "--dataset-name",
            "multiturn",
            "--num-prompts",
            "3",
            "--multiturn-turns",
            "3",
            "--multiturn-system-len",
            "40",
            "--random-input-len",
            "6",
            "--random-output-len",
            "5",
            "--random-range-ratio",
            "1",
            "--output-file",
            str(jsonl),
            "--disable-tqdm",
        ]
    )
    (record,) = read_jsonl(jsonl)
    rows = check_serving(capsys.readouterr().out, record, 9, 5)
    assert record["num_prompts"] == 3 and record["num_requests"] == 9
    # turn t's prompt: 40 + t * (6 + 5) + 6 tokens
    assert record["total_input_tokens"] == 3 * sum(40 + t * 11 + 6 for t in range(3))
    # at least every later turn's resent history (all but the last answer token) was cached
    resent = 3 * sum(40 + t * 11 - 1 for t in (1, 2))
    assert record["cache_hit_rate"] >= resent / record["total_input_tokens"]
    assert close(float(rows["Prefix cache hit rate:"]), record["cache_hit_rate"])
    for key in ("mean_ttft_turn1_ms", "mean_ttft_turn2plus_ms", "median_ttft_turn2plus_ms"):
        assert record[key] > 0


def test_serving_compare_radix_cache(ckpt, tmp_path, capsys):
    jsonl = tmp_path / "serving.jsonl"
    script("bench_serving").main(
        [
            "--launch-server",
            "--compare-radix-cache",
            "--model-path",
            str(ckpt),
            *COMMON,
            "--dataset-name",
            "multiturn",
            "--num-prompts",
            "2",
            "--multiturn-turns",
            "2",
            "--multiturn-system-len",
            "40",
            "--random-input-len",
            "6",
            "--random-output-len",
            "4",
            "--random-range-ratio",
            "1",
            "--output-file",
            str(jsonl),
        ]
    )
    text = capsys.readouterr().out
    off, on = read_jsonl(jsonl)
    assert (off["variant"], on["variant"]) == ("plain cache-off", "plain cache-on")
    assert off["cache_hit_rate"] == 0 < on["cache_hit_rate"]
    assert "--disable-radix-cache" in text.split("launching:")[1].splitlines()[0]
    assert "--disable-radix-cache" not in text.split("launching:")[2].splitlines()[0]
    got = ratios(text)
    assert close(
        got["plain cache on/off mean TTFT turns 2+"],
        on["mean_ttft_turn2plus_ms"] / off["mean_ttft_turn2plus_ms"],
        abs_=1e-3,
    )
    assert close(
        got["plain cache on/off output token throughput"],
        on["output_throughput"] / off["output_throughput"],
        abs_=1e-3,
    )


def test_multiturn_needs_the_native_backend(capsys):
    with pytest.raises(SystemExit):
        script("bench_serving").main(["--dataset-name", "multiturn", "--backend", "sglang-oai"])
    assert "use --backend sglang" in capsys.readouterr().err


def test_one_batch_prefills_are_fresh_and_repeated(ckpt, tmp_path, monkeypatch):
    """Every timed prefill starts from an empty prefix cache (the file has only two prompts,
    so warm-up and measured batches share them and a cached prefix could be reused), and
    `--prefill-repeats` times that many fresh prefills of ours and of HF's."""
    fib = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    total = "for item in items:\n    total = total + item.price * item.count\n"
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": fib}) + "\n" + json.dumps({"prompt": total}))
    bench = script("bench_one_batch")
    cached_before = {"run": [], "repeat": []}

    def run_batch(engine, prompts, output_len, real=bench.run_batch):
        cached_before["run"].append(engine.prefix_cache.stats().cached_tokens)
        return real(engine, prompts, output_len)

    def time_prefill(engine, prompts, real=bench.time_prefill):
        seconds = real(engine, prompts)
        cached_before["repeat"].append(len(prompts))
        return seconds

    hf_new_tokens = []

    def hf_generate(model, ids, mask, new_tokens, real=hf_baseline.hf_generate):
        hf_new_tokens.append(new_tokens)
        return real(model, ids, mask, new_tokens)

    monkeypatch.setattr(bench, "run_batch", run_batch)
    monkeypatch.setattr(bench, "time_prefill", time_prefill)
    monkeypatch.setattr(hf_baseline, "hf_generate", hf_generate)
    out = bench.main(
        ["--model-path", str(ckpt), *COMMON, "--batch-size", "2", "--input-len", "40"]
        + ["--output-len", "4", "--dataset-path", str(data), "--hf-baseline"]
        + ["--prefill-repeats", "3", "--hf-same-process"]  # the patched generate runs here
    )
    # warm-up, measured batch, two repeats: the warm-up's prompts were cached, then flushed
    assert cached_before["run"] == [0, 0, 0, 0]
    assert cached_before["repeat"] == [2, 2]
    assert hf_new_tokens.count(1) == 2
    assert out["hf_rows"][0]["same_greedy_tokens_as_ours"] == "2/2"


def test_one_batch_repeats_take_turns_and_report_the_median_run(ckpt, monkeypatch):
    """`--repeats 3`: both engines are warmed first, then every setting runs three times with
    plain and NEXTN alternating, and each reported row is that variant's run of median
    decode throughput."""
    bench = script("bench_one_batch")
    order, runs = [], {}

    def measure_setting(engine, variant, args, setting, real=bench.measure_setting):
        row = real(engine, variant, args, setting)
        order.append((variant.label, setting[0]))
        runs.setdefault((variant.label, setting[0]), []).append(row)
        return row

    monkeypatch.setattr(bench, "measure_setting", measure_setting)
    out = bench.main(
        ["--model-path", str(ckpt), *COMMON, "--compare", "--repeats", "3"]
        + ["--batch-size", "1", "2", "--input-len", "6", "--output-len", "4"]
    )
    labels = [label for label, _ in order]
    assert labels == ["plain", "NEXTN(steps=3)"] * 6  # the variants take turns
    assert [bs for _, bs in order] == [1, 1, 2, 2] * 3
    assert len(out["rows"]) == 4
    for row in out["rows"]:
        mine = runs[(row["variant"], row["batch_size"])]
        throughputs = sorted(r["decode_throughput"] for r in mine)
        assert len(mine) == 3 and any(row is r for r in mine)
        assert row["decode_throughput"] == throughputs[1]


def test_compiled_code_timer_times_inductor_calls_and_comes_off():
    """`--profile-overhead` splits a captured call into inductor's compiled code and the
    wrappers around it: the timer counts each compiled call, its time fits inside the
    calls' wall time, and removing it restores inductor's own method."""
    from torch._inductor.output_code import CompiledFxGraph

    from scripts.bench.overhead import CompiledCodeTimer

    original = CompiledFxGraph.__call__
    fn = torch.compile(lambda x: (x.sin() * 2).cos().sum(), dynamic=False)
    x = torch.randn(64)
    expected = (x.sin() * 2).cos().sum()
    fn(x)  # compile outside the timer
    timer = CompiledCodeTimer()
    try:
        start = time.perf_counter()
        for _ in range(3):
            assert torch.allclose(fn(x), expected)
        wall = time.perf_counter() - start
        assert timer.calls == 3 and 0.0 < timer.seconds <= wall
    finally:
        timer.remove()
    assert CompiledFxGraph.__call__ is original


def test_compare_fused_round_adds_a_step_by_step_variant_each_server_accepts(ckpt):
    """`--compare-fused-round`: every NEXTN variant is followed by the same one with its
    greedy rounds run step by step; in-process engines get the setting, and a launched
    server's command line carries it as the switch launch_server parses."""
    from runtime.server_args import ServerArgs
    from scripts.bench.launched_server import LaunchedServer
    from scripts.bench.variants import build_variants

    args = script("bench_serving").parse_args(
        ["--launch-server", "--compare", "--compare-fused-round", "--model-path", str(ckpt)]
        + ["--speculative-num-steps", "2", "3"]
    )
    variants = build_variants(args)
    assert [v.label for v in variants] == [
        "plain",
        "NEXTN(steps=2)",
        "NEXTN(steps=2, step by step)",
        "NEXTN(steps=3)",
        "NEXTN(steps=3, step by step)",
    ]
    for fused, split in zip(variants[1::2], variants[2::2]):
        assert split.spec == {**fused.spec, "disable_fused_nextn_round": True}
        for variant, disabled in ((fused, False), (split, True)):
            cmd = LaunchedServer(args, variant).cmd
            server = ServerArgs.from_cli(cmd[cmd.index("runtime.launch_server") + 1 :])
            assert server.disable_fused_nextn_round is disabled
            assert server.speculative_num_steps == variant.num_steps


def test_forward_timer_times_the_named_methods_and_comes_off():
    """`--profile-overhead` times a fused NEXTN round (`CapturedRound.run`) as a forward:
    the timer sums the wrapped method's wall time, passes its result through, and its
    removal leaves the class's method in place."""
    from scripts.bench.overhead import ForwardTimer

    class Round:
        def run(self, inp):
            time.sleep(0.02)
            return inp + 1

    fused = Round()
    timer = ForwardTimer(fused, ("run",))
    assert fused.run(1) == 2 and timer.forward_s >= 0.02
    timer.remove()
    assert "run" not in vars(fused) and fused.run(2) == 3
