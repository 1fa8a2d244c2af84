# SPDX-License-Identifier: Apache-2.0
"""Errors that cross package boundaries."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the caller must fix (bad parameter, prompt too long, ...): the server
    answers it with a 4xx naming what to change, before the request reaches the engine."""
