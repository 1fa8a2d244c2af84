# SPDX-License-Identifier: Apache-2.0
"""Architecture name -> model class, discovered from every `runtime.models` module that
exports `EntryClass`."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

import runtime.models as models_pkg


class UnsupportedArchitectureError(ValueError):
    pass


@cache
def model_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(models_pkg.__path__):
        if info.name == "registry":
            continue
        module = importlib.import_module(f"{models_pkg.__name__}.{info.name}")
        entry = getattr(module, "EntryClass", None)
        if entry is None:
            continue
        for cls in entry if isinstance(entry, (list, tuple)) else [entry]:
            if cls.__name__ in found:
                raise RuntimeError(f"architecture {cls.__name__} is exported twice")
            found[cls.__name__] = cls
    return found


def supported_architectures() -> list[str]:
    return sorted(model_classes())


def resolve_model_class(architectures: list[str] | tuple[str, ...]) -> type:
    """The class for the first architecture we serve; a clear error otherwise."""
    classes = model_classes()
    for arch in architectures:
        if arch in classes:
            return classes[arch]
    raise UnsupportedArchitectureError(
        f"unsupported architecture {list(architectures)}; "
        f"supported: {', '.join(supported_architectures())}"
    )
