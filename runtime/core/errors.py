# SPDX-License-Identifier: Apache-2.0
"""Errors that cross package boundaries."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the caller must fix (bad parameter, prompt too long, ...): the server
    answers it with a 4xx naming what to change, before the request reaches the engine.
    `param` names the offending field when there is one (OpenAI's error `param`)."""

    status = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class DuplicateRequestError(InvalidRequestError):
    """A request id that a live request already uses (409 Conflict over HTTP)."""

    status = 409
