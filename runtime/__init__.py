# SPDX-License-Identifier: Apache-2.0
"""nextn-runtime: an LLM serving runtime with MTP (NextN) speculative decoding."""

from __future__ import annotations

from runtime.core.version import __version__


def __getattr__(name: str):
    # Importing the engine pulls in torch and transformers; do it only when asked.
    if name == "Engine":
        from runtime.engine.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "__version__"]
