# SPDX-License-Identifier: Apache-2.0
"""The project's Triton kernels (CUDA): fused blocks whose torch form is many small
operators, each behind a `torch.library.custom_op` whose CUDA kernel launches them.

Triton is imported only by the kernel modules here, which their ops import on first use
on a CUDA tensor: a machine without Triton imports this package, `available()` is False,
and every caller keeps its torch form. `NEXTN_DISABLE_TRITON_KERNELS=1` (read at import)
keeps them off where Triton is installed (the torch forms are the reference).
"""

from __future__ import annotations

import importlib.util
import os

DISABLE_ENV = "NEXTN_DISABLE_TRITON_KERNELS"
# found, not imported: importing Triton costs seconds, and only a CUDA step needs it
_AVAILABLE = importlib.util.find_spec("triton") is not None and not os.environ.get(DISABLE_ENV)


def available() -> bool:
    """Whether CUDA tensors may use the Triton kernels: Triton is installed and they are
    not turned off."""
    return _AVAILABLE
