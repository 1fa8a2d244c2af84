# SPDX-License-Identifier: Apache-2.0
"""Captured steps kept on disk whole, so that a second start loads them instead of tracing.

Inductor's caches spare a second start the compile of a step, not dynamo's trace of it.
torch's AOT precompile (`torch.compile(fn, fullgraph=True).aot_compile(...)` with
`save_compiled_function` / `torch.compiler.load_compiled_function`, experimental in torch
2.13) saves the traced and compiled step as one artifact, whose calls skip dynamo's frame
evaluation.

Invariants: an artifact holds the step's bytecode, graph and kernels, never weights or
caches (those are the live objects of the step's closure, handed over as external data,
`external_objects`) and no guards; instead the file name is a `fingerprint` of everything
the trace could have baked in, so anything that differs loads nothing and compiles afresh,
and a loaded step must match the eager step on the padding batch (`outputs_match`) before
use. The store keeps itself under `STORE_MAX_BYTES` (`StepStore.prune`, at start-up).
What the fingerprint covers: docs/captured_decode.md, "Module notes".
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import os
import platform
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from runtime.kernels import cpu_extension, dense_product, tile_product

logger = logging.getLogger(__name__)

PRIMITIVES = (bool, int, float, complex, str, bytes, type(None))
# packages whose code a step traces: their module constants (`SORTED_MIN_PAIRS`, ...) shape
# the graph
TRACED_PACKAGES = ("runtime.layers.", "runtime.kernels.", "runtime.models.")
# how deep `fingerprint` walks into plain objects (a runner's pool, its layout, the layout's
# per-layer tuples)
DESCRIBE_DEPTH = 5
ARTIFACT_SUFFIX = ".pt2step"
# an artifact's outputs on the padding batch against the eager step's: the compiler's
# fusion moves results by rounding only
MATCH_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
# the store's size limit: past it the least recently used artifacts go (`StepStore.prune`)
STORE_MAX_BYTES = 4 << 30
LOW_PRECISION_TOLERANCE = 5e-2


def _no_guards(entries):
    """Keep none of dynamo's guards with the artifact (see the module docstring)."""
    return [False] * len(entries)


def precompile(fn: Callable, args: tuple, options: dict) -> Callable:
    """`fn` traced as one graph on `args` and compiled by inductor with `options`, as an
    AOT-compiled function that can be saved; its calls skip guard evaluation."""
    compiled = torch.compile(
        fn, fullgraph=True, dynamic=False, options={**options, "guard_filter_fn": _no_guards}
    )
    step = compiled.aot_compile((args, {}))
    step.disable_guard_check()
    return step


def external_objects(fn: Callable) -> dict[str, object]:
    """What a step's artifact refers to instead of holding: each object its closure names,
    keyed by the cell's position (the same position in a later process's copy of the step).
    Plain values (numbers, strings, tuples of them) are saved with it."""
    cells = fn.__closure__ or ()
    return {
        f"cell{i}": cell.cell_contents
        for i, cell in enumerate(cells)
        if not _plain(cell.cell_contents)
    }


def _plain(value) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_plain(v) for v in value)
    return isinstance(value, PRIMITIVES) or isinstance(value, enum.Enum)


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A hash of the runtime package's Python and C++ sources: a change to any of them can
    change what a step traces to or what it calls."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


_vec_isa_lock = threading.Lock()


def platform_description() -> str:
    """torch, Python, machine and the compiler's vector ISA, probed by one thread at a time.

    Inductor's AVX-512 probe (`VecAVX512.__bool__` in torch 2.13) appends `-mavx512bf16` to
    the ISA's shared flags while it test-builds, then restores them; two threads probing at
    once (the target's and the draft's compile workers both start by preparing the store)
    can leave the flag there for good. Those flags are part of the hash a C++ wrapper is
    cached under, so a process that compiled steps with the flag and a later one that loads
    them without it looked for different wrappers and rebuilt each (minutes per step on a
    2-core AVX512-BF16 machine, which is what a warm start of a server paid)."""
    with _vec_isa_lock:
        return _platform_description()


@functools.lru_cache(maxsize=1)
def _platform_description() -> str:
    from torch._inductor import cpu_vec_isa

    return "|".join(
        (torch.__version__, sys.version, platform.machine(), str(cpu_vec_isa.pick_vec_isa()))
    )


def prepare() -> None:
    """Do once what a process's first load of a step would (seconds of CPU): import
    the compiler's runtime and compute the process-wide parts of a fingerprint (probing the
    CPU's vector ISA builds a test program). A background thread runs it at start-up, so a
    first load under traffic does not pay for it at the thread's low priority."""
    import torch._dynamo.aot_compile  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    platform_description()
    source_digest()
    compiler_settings()


def compiler_settings() -> tuple:
    """Dynamo's and inductor's settings (what their own cache keys hold)."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    return describe(
        (dynamo_config.save_config_portable(), inductor_config.save_config_portable()), 8
    )


def traced_constants() -> tuple:
    """The upper-case plain constants of the loaded modules whose code steps trace."""
    return tuple(
        (name, key, repr(value))
        for name, module in sorted(sys.modules.items())
        if name.startswith(TRACED_PACKAGES) and module is not None
        for key, value in sorted(vars(module).items())
        if key.isupper() and _plain(value)
    )


def fingerprint(fn: Callable, args: tuple, options: dict, label: str) -> str:
    """A hash of everything a compile of `fn` on `args` could depend on (see the module
    docstring). Objects may describe themselves with a `compile_fingerprint()` method."""
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("NEXTN_"))
    closure = [c.cell_contents for c in fn.__closure__ or ()]
    parts = (
        platform_description(),
        compiler_settings(),
        source_digest(),
        traced_constants(),
        cpu_extension.available(),
        tile_product.ready(),
        dense_product.enabled(),
        label,
        fn.__code__.co_name,
        describe({k: v for k, v in options.items() if not callable(v)}),
        describe(env),
        describe(args),
        describe(closure),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def describe(value, depth: int = DESCRIBE_DEPTH, seen: set | None = None):
    """A nested tuple of strings standing for what `value` contributes to a trace: tensors
    by their metadata, modules by their structure, plain objects by their public attributes
    (`_`-prefixed ones hold run-time state, not configuration)."""
    seen = set() if seen is None else seen
    if isinstance(value, PRIMITIVES) or isinstance(value, (enum.Enum, torch.dtype)):
        return repr(value)
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), str(value.dtype), str(value.device))
    if id(value) in seen:
        return "<seen>"
    seen.add(id(value))
    if hasattr(value, "compile_fingerprint") and not isinstance(value, type):
        return (type(value).__qualname__, describe(value.compile_fingerprint(), depth, seen))
    if isinstance(value, nn.Module):
        return describe_module(value, seen)
    if isinstance(value, types.MethodType):
        return ("method", value.__func__.__qualname__, describe(value.__self__, depth, seen))
    if isinstance(value, types.FunctionType):
        cells = [c.cell_contents for c in value.__closure__ or ()]
        return ("function", value.__qualname__, describe(cells, depth, seen))
    if depth <= 0:
        return type(value).__qualname__
    if isinstance(value, (list, tuple)):
        return tuple(describe(v, depth - 1, seen) for v in value)
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(describe(v, depth - 1, seen)) for v in value)))
    if isinstance(value, dict):
        return tuple(
            (repr(k), describe(v, depth - 1, seen)) for k, v in sorted(value.items(), key=repr)
        )
    if dataclasses.is_dataclass(value):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__"):
        items = list(vars(value).items())
    else:
        return type(value).__qualname__
    return (
        type(value).__qualname__,
        tuple(
            (name, describe(item, depth - 1, seen))
            for name, item in items
            if not name.startswith("_")
        ),
    )


def describe_module(module: nn.Module, seen: set) -> tuple:
    """A module's structure: each submodule's class and public attributes, each parameter's
    and buffer's name and metadata (their values are read at every call, not saved)."""
    modules = tuple(
        (
            name,
            type(m).__qualname__,
            tuple(
                (k, describe(v, 2, seen))
                for k, v in vars(m).items()
                if not k.startswith("_") and k != "training"
            ),
        )
        for name, m in module.named_modules()
    )
    tensors = tuple(
        (name, describe(t)) for name, t in (*module.named_parameters(), *module.named_buffers())
    )
    return (type(module).__qualname__, modules, tensors)


def outputs_match(got, expected) -> bool:
    """Whether a loaded step's outputs are the eager step's on the same batch, within the
    rounding a compiler's fusion causes (floating outputs) or exactly (integer outputs)."""
    got, expected = _flat(got), _flat(expected)
    if len(got) != len(expected):
        return False
    for a, b in zip(got, expected):
        if a is None or b is None:
            if a is not b:
                return False
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            tol = MATCH_TOLERANCE.get(a.dtype, LOW_PRECISION_TOLERANCE)
            if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol, equal_nan=True):
                return False
    return True


def _flat(value) -> list:
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _flat(getattr(value, f.name))]
    return [value]


class StepStore:
    """Precompiled steps under `directory`, one file per fingerprint."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def path(self, name: str, digest: str) -> Path:
        return self.directory / f"{name}-{digest[:32]}{ARTIFACT_SUFFIX}"

    def load(self, path: Path, fn: Callable) -> Callable | None:
        """The step saved at `path` bound to `fn`'s closure objects, or None when there is
        none or it cannot be read (it is then compiled afresh and saved over)."""
        if not path.exists():
            return None
        try:
            with open(path, "rb") as f:
                step = torch.compiler.load_compiled_function(
                    f, f_globals=fn.__globals__, external_data=external_objects(fn)
                )
        except Exception as err:  # a stale or damaged artifact: compile afresh
            logger.warning("could not load the compiled step %s, compiling it: %s", path, err)
            return None
        step.disable_guard_check()
        try:
            os.utime(path)  # a use: `prune` removes the least recently used first
        except OSError:
            pass
        return step

    def save(self, path: Path, step, fn: Callable) -> bool:
        """Save a precompiled step; False (logged) when it cannot be saved."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            step.save_compiled_function(str(path), external_data=external_objects(fn))
        except Exception as err:  # the step still serves; only the next start traces again
            logger.warning("could not save the compiled step %s: %s", path.name, err)
            return False
        return True

    def prune(self, max_bytes: int = STORE_MAX_BYTES) -> list[Path]:
        """Remove the least recently saved or loaded artifacts until the store holds at most
        `max_bytes`; returns the removed paths. Every upgrade of torch or of the runtime's
        sources changes every fingerprint, so the artifacts of the old versions are never
        loaded again; without a limit the store would only grow (a few MB per step and
        bucket, hundreds of MB per version of a NEXTN engine with several buckets)."""
        entries = []
        for path in self.directory.glob(f"*{ARTIFACT_SUFFIX}"):
            try:
                info = path.stat()
            except OSError:  # removed meanwhile (another process prunes too)
                continue
            entries.append((info.st_mtime, info.st_size, path))
        total = sum(size for _, size, _ in entries)
        removed, freed = [], 0
        for _, size, path in sorted(entries):
            if total - freed <= max_bytes:
                break
            path.unlink(missing_ok=True)
            freed += size
            removed.append(path)
        if removed:
            logger.info(
                "step store: removed %d least recently used steps (%.0f MB) to stay under %.1f GB",
                len(removed),
                freed / 1e6,
                max_bytes / 1e9,
            )
        return removed
