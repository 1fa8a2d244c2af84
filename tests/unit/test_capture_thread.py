# SPDX-License-Identifier: Apache-2.0
"""`runtime.core.capture`: a compile on one thread is not a capture on another.

`torch.compiler.is_compiling()` is process-wide (dynamo holds it for a whole compile), so
while the graph runner compiled a step in its background thread, the serving thread's
eager steps took the captured forms and left the eager kernels. `compiling()` and
`in_capture()` are True only on the thread the graph runner marks (`compiling_here`), or on
the calling thread of a compile nobody marked."""

from __future__ import annotations

import threading
import time

import torch

from runtime.core import capture
from runtime.kernels import cpu_extension


def form(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if capture.in_capture() else x * 3


def slow_backend(gm, example_inputs):
    time.sleep(1.0)  # a compile that takes a while: torch's flag stays up meanwhile
    return gm.forward


def test_the_check_traces_into_one_graph_and_a_test_compile_counts_as_its_threads():
    explained = torch._dynamo.explain(form)(torch.ones(3))
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(form, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert torch.equal(form(torch.ones(3)), torch.full((3,), 3.0))
    torch._dynamo.reset()


def test_a_marked_compile_on_another_thread_leaves_this_thread_eager():
    out = {}

    def compile_in_background():
        with capture.compiling_here():
            out["y"] = torch.compile(form, backend=slow_backend)(torch.ones(4))

    torch._dynamo.reset()
    worker = threading.Thread(target=compile_in_background)
    worker.start()
    seen = []
    while worker.is_alive():
        seen.append((torch.compiler.is_compiling(), capture.compiling(), capture.in_capture()))
        with torch.inference_mode():
            seen[-1] += (cpu_extension.serves_eagerly(torch.ones(2)),)
        time.sleep(0.005)
    worker.join()
    torch._dynamo.reset()
    assert any(flag for flag, *_ in seen)  # torch's flag was up here during the compile
    assert not any(ours or captured for _, ours, captured, _ in seen)
    # the eager kernels keep serving this thread (where they are loaded at all)
    assert all(eager == cpu_extension.available() for *_, eager in seen)
    assert torch.equal(out["y"], torch.full((4,), 2.0))  # the compiling thread's: captured
    assert capture._compiling_thread is None
