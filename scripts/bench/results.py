# SPDX-License-Identifier: Apache-2.0
"""Result files: one JSON document per benchmark run, the data `docs/benchmarks.md` is
rendered from (`python -m scripts.bench.render`).

A document records what reproduces and qualifies its figures: the exact command line, the
date, the machine (CPU model, notable ISA flags, core count, GPU model when one ran), the
torch version, the git commit of the tree, the headline figures (ratios measured in the
same run, throughputs, accept lengths) and the run's full records. `source` says whether the
benchmark wrote it ("measured") or a person transcribed it from an older log.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
DEFAULT_RESULTS_DIR = "docs/benchmark_results"
# /proc/cpuinfo flags that decide which CPU kernels run (bf16 and AMX tiles, AVX-512, AVX2)
NOTABLE_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
MEASURED = "measured"


def cpu_description(cpuinfo: str) -> tuple[str | None, list[str]]:
    """(model name, the notable ISA flags present) from the text of /proc/cpuinfo."""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    present = set(flags.group(1).split()) if flags else set()
    return (
        model.group(1).strip() if model else None,
        [f for f in NOTABLE_ISA_FLAGS if f in present],
    )


def machine_info(device: str = "cpu") -> dict:
    """The machine a run measured: CPU model and ISA flags (Linux), cores, and the GPU's
    model when `device` is a CUDA device."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    cpu, isa = cpu_description(cpuinfo)
    gpu = None
    if str(device).startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(torch.device(device))
    return {
        "cpu": cpu or platform.processor() or None,
        "isa": isa,
        "cores": os.cpu_count(),
        "gpu": gpu,
    }


def git_commit(root: Path = REPO_ROOT) -> str | None:
    """HEAD of the tree the benchmark ran from, with "-dirty" when it had uncommitted changes
    to tracked files; None outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def command_line(tool: str, argv: list[str] | None) -> str:
    """The command that reproduces a run: `python -m scripts.TOOL` and its arguments."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "-m", f"scripts.{tool}", *args])


def figure(name: str, value: float | None, unit: str = "") -> dict:
    """One headline figure; ratios keep three decimals, everything else two."""
    digits = 3 if unit == "x" else 2
    return {"name": name, "value": None if value is None else round(value, digits), "unit": unit}


def new_result(
    benchmark: str,
    command: str,
    figures: list[dict],
    records: list[dict],
    device: str = "cpu",
) -> dict:
    """A measured run's document (see the module docstring)."""
    import torch

    return {
        "benchmark": benchmark,
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(device),
        "torch": torch.__version__,
        "commit": git_commit(),
        "source": MEASURED,
        "figures": [f for f in figures if f["value"] is not None],
        "records": records,
    }


def write_result(directory: str | Path, result: dict) -> Path:
    """Write `result` as `DIR/<time>_<benchmark>.json` (a new file per run) and return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H%M%S")
    path = directory / f"{stamp}_{result['benchmark']}.json"
    n = 1
    while path.exists():
        n += 1
        path = directory / f"{stamp}_{result['benchmark']}_{n}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"result written to {path}")
    return path


def _names(labels: list[str]) -> dict[str, str]:
    """Short names for figures: the one speculative variant of a run is just "NEXTN"."""
    others = {label for label in labels if label != "plain"}
    return {label: ("NEXTN" if len(others) == 1 and label in others else label) for label in labels}


def one_batch_figures(rows: list[dict], hf_rows: list[dict], labels: list[str]) -> list[dict]:
    """`bench_one_batch`'s ratios per setting, as its summary prints them."""
    names = _names(labels)
    by_key = {
        (r["variant"], r["batch_size"], r["input_len"], r["output_len"]): r for r in rows + hf_rows
    }
    settings = sorted({(r["batch_size"], r["input_len"], r["output_len"]) for r in rows})
    shapes = {(il, ol) for _, il, ol in settings}
    out = []
    for bs, il, ol in settings:
        tag = f"batch {bs}" + (f", input {il}, output {ol}" if len(shapes) > 1 else "")
        plain, hf = by_key.get(("plain", bs, il, ol)), by_key.get(("HF", bs, il, ol))
        for label in labels:
            ours = by_key[(label, bs, il, ol)]
            name = names[label]
            if hf is not None:
                out.append(
                    figure(
                        f"{name} / HF decode tok/s, {tag}",
                        ours["decode_throughput"] / hf["decode_throughput"],
                        "x",
                    )
                )
                out.append(
                    figure(
                        f"{name} / HF prefill tok/s, {tag}",
                        ours["prefill_throughput"] / hf["prefill_throughput"],
                        "x",
                    )
                )
            if plain is not None and label != "plain":
                out.append(
                    figure(
                        f"{name} / plain decode tok/s, {tag}",
                        ours["decode_throughput"] / plain["decode_throughput"],
                        "x",
                    )
                )
                out.append(figure(f"{name} accept length, {tag}", ours["accept_length"]))
    return out


def offline_figures(results: list[tuple[str, dict]], hf: dict | None) -> list[dict]:
    """`bench_offline_throughput`'s output throughputs and ratios (`results`: (label, result))."""
    names = _names([label for label, _ in results])
    plain = next((r for label, r in results if label == "plain"), None)
    out = []
    for label, r in results:
        name = names[label]
        out.append(figure(f"{name} output tok/s", r["output_throughput"], "tok/s"))
        if plain is not None and label != "plain":
            out.append(
                figure(
                    f"{name} / plain output tok/s",
                    r["output_throughput"] / plain["output_throughput"],
                    "x",
                )
            )
        if label != "plain":
            out.append(figure(f"{name} accept length", r["accept_length"]))
        if hf is not None:
            out.append(
                figure(
                    f"{name} / HF (best batch) output tok/s",
                    r["output_throughput"] / hf["output_throughput"],
                    "x",
                )
            )
    if hf is not None:
        out.append(figure("HF (best batch) output tok/s", hf["output_throughput"], "tok/s"))
    return out


def serving_figures(records: list[dict], labels: list[str]) -> list[dict]:
    """`bench_serving`'s output throughputs, NEXTN/plain and radix cache on/off ratios."""
    names = _names([label.removesuffix(" cache-on").removesuffix(" cache-off") for label in labels])
    by_label = dict(zip(labels, records, strict=True))
    plain = by_label.get("plain")
    out = []
    for label, r in by_label.items():
        base = label.removesuffix(" cache-on").removesuffix(" cache-off")
        name = names.get(base, base) + label[len(base) :]
        out.append(figure(f"{name} output tok/s", r["output_throughput"], "tok/s"))
        if plain is not None and label != "plain":
            out.append(
                figure(
                    f"{name} / plain output tok/s",
                    r["output_throughput"] / plain["output_throughput"],
                    "x",
                )
            )
        if base != "plain":
            out.append(figure(f"{name} accept length", r.get("accept_length")))
        off = by_label.get(base + " cache-off")
        if label.endswith(" cache-on") and off is not None:
            out.append(
                figure(
                    f"{names.get(base, base)} cache on / off output tok/s",
                    r["output_throughput"] / off["output_throughput"],
                    "x",
                )
            )
    return out
