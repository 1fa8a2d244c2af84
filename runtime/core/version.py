# SPDX-License-Identifier: Apache-2.0
"""The package version: the installed distribution's metadata, else the source tree's."""

from __future__ import annotations

from importlib import metadata

__version__ = "0.1.0"  # the source tree's version; setup.py installs the same
DISTRIBUTION = "nextn-runtime"


def package_version() -> str:
    """`nextn-runtime`'s installed version (PEP 566 metadata); `__version__` when the
    package runs from a source tree without being installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return __version__
