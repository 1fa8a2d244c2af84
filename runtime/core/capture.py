# SPDX-License-Identifier: Apache-2.0
"""Whether the code running now is being captured into a static graph.

Captured steps (`torch.compile` on CPU, CUDA graphs on GPU) cannot hold host syncs or
shapes that depend on data; a few kernels have a fast eager form with such ops and a
fixed-shape form, and pick by this.
"""

from __future__ import annotations

import torch


def in_capture() -> bool:
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
