# SPDX-License-Identifier: Apache-2.0
"""Whether the code running now is being captured into a static graph.

Captured steps (`torch.compile` on CPU, CUDA graphs on GPU) cannot hold host syncs or
shapes that depend on data; a few kernels have a fast eager form with such ops and a
fixed-shape form, and pick by this.

`torch.compiler.is_compiling()` is one flag for the whole process: while any thread
compiles, it is True in every thread (dynamo holds it for a whole compile). So while the
graph runner compiles a step in its background thread, the serving thread's eager steps
would take the captured steps' forms and leave the eager kernels (not the forms meant for
them, though a probe measured no cost from it). The graph runner marks the thread it compiles on
(`compiling_here`), and `compiling()` is True only there; a compile nobody marked (a test's
`torch.compile`, a user's) is taken as the calling thread's.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_compiling_thread: int | None = None  # the thread the graph runner compiles on, meanwhile


@contextlib.contextmanager
def compiling_here():
    """Mark the calling thread as the one whose compiles count (`compiling`)."""
    global _compiling_thread
    previous, _compiling_thread = _compiling_thread, threading.get_ident()
    try:
        yield
    finally:
        _compiling_thread = previous


@torch.compiler.assume_constant_result
def _compiles_on_this_thread() -> bool:
    # evaluated when traced, on the tracing thread: a constant of the graph, no break
    owner = _compiling_thread
    return owner is None or owner == threading.get_ident()


def compiling() -> bool:
    """Whether this thread is tracing a graph (`torch.compiler.is_compiling()` for this
    thread alone)."""
    return torch.compiler.is_compiling() and _compiles_on_this_thread()


def in_capture() -> bool:
    if compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
