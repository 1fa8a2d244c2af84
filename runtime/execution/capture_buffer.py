# SPDX-License-Identifier: Apache-2.0
"""CUDA-graph capture and replay (SGLang's `CudaGraphRunner` capture/replay split).

`record` warms a step up on a side stream, then records it into a `torch.cuda.CUDAGraph`
whose static inputs are the padding batch's tensors; every graph of one runner shares one
memory pool. `replay` copies a live batch (padded to the same bucket, so the same shapes)
into those static inputs and replays. Contract: replays run one at a time, and a replay's
outputs are the graph's static outputs, overwritten by the next replay: callers copy what
they keep before replaying again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass

import torch

CudaGraph = tuple  # (graph, static inputs, static outputs)


def tensors_of(value) -> list[torch.Tensor]:
    """Every tensor inside nested dataclasses, dicts, lists and tuples, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if is_dataclass(value) and not isinstance(value, type):
        return [t for f in fields(value) for t in tensors_of(getattr(value, f.name))]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in tensors_of(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


class CaptureBuffers:
    """The CUDA graphs of one runner's steps, on `device`, in one memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self._graph_pool = None  # made at the first recording

    def record(self, fn: Callable, args: tuple) -> CudaGraph:
        """Warm up on a side stream, then record `fn(*args)` into a CUDA graph whose inputs
        are `args`' tensors (later batches are copied into them)."""
        # streams and the capture belong to the model's GPU, whichever is the thread's current
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            # one memory pool for every graph (as SGLang's runner does): replays run one at a
            # time and callers copy a replay's outputs before the next one can overwrite them
            with torch.cuda.graph(graph, pool=self._graph_pool):
                outputs = fn(*args)
        return graph, args, outputs

    def replay(self, recorded: CudaGraph, args: tuple):
        """The recorded graph's outputs on `args` (its static outputs: see the contract)."""
        graph, static, outputs = recorded
        with torch.cuda.device(self.device):  # copies and launch on the model's GPU's stream
            for dst, src in zip(tensors_of(static), tensors_of(args), strict=True):
                if dst.data_ptr() != src.data_ptr():  # the shared caches are the same tensors
                    dst.copy_(src)
            graph.replay()
        return outputs
