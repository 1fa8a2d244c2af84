# SPDX-License-Identifier: Apache-2.0
"""Where torch's compilers keep what they build: under the runtime's cache directory.

Inductor keeps its FX graph, AOT autograd and kernel caches in `$TORCHINDUCTOR_CACHE_DIR`
(default `<tmp>/torchinductor_<user>`), and Triton its kernels in `$TRITON_CACHE_DIR`
(inductor's default: `<inductor cache>/triton/<device>`; Triton's own: `~/.triton/cache`).
The runtime points both under its cache directory (`$NEXTN_CACHE_DIR`) unless the user
chose them, so that one folder holds everything a start compiles and survives the temporary
folder's clean-ups.

torch writes its default into the environment the first time it is asked for the folder,
which `import torch._dynamo` does (torch 2.13: `torch._dynamo.package` creates its disk
cache at import); `import runtime` imports it. So a `TORCHINDUCTOR_CACHE_DIR` holding
torch's default (or a `TRITON_CACHE_DIR` inside it) counts as unset: it cannot be told from
the user's choice of that very folder, which would move here too.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"


def torch_default_inductor_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def user_chose(name: str) -> bool:
    """Whether `$name` was set by the user rather than by torch's own defaults."""
    value = os.environ.get(name)
    if not value:
        return False
    default = torch_default_inductor_dir()
    value = os.path.abspath(value)
    if name == INDUCTOR_ENV:
        return value != default
    return os.path.commonpath([value, default]) != default


def point_compiler_caches(cache_dir: Path) -> dict[str, str]:
    """Point inductor's caches (and Triton's, where Triton is installed) under `cache_dir`,
    each left where the user set it; call before anything compiles. Returns the folders
    in use, by variable."""
    wanted = {INDUCTOR_ENV: Path(cache_dir) / "inductor"}
    if importlib.util.find_spec("triton") is not None:
        wanted[TRITON_ENV] = Path(cache_dir) / "triton"
    for name, path in wanted.items():
        if not user_chose(name):
            path.mkdir(parents=True, exist_ok=True)
            os.environ[name] = str(path)
    return {name: os.environ[name] for name in wanted}
