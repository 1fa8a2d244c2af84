# SPDX-License-Identifier: Apache-2.0
"""`launch_server --help` is the flag reference the README points to: every flag has help
text, and every flag with a fixed default shows it (or says in words what it defaults to)."""

from __future__ import annotations

import dataclasses
import re

from runtime.server_args import ServerArgs


def flag_help(text: str) -> dict[str, str]:
    """--flag -> its help text, from argparse's formatted help (wrapped lines joined)."""
    out, current = {}, None
    for line in text.splitlines():
        match = re.match(r"^  (--[a-z0-9-]+)(.*)$", line)
        if match:
            current = match.group(1)
            out[current] = match.group(2)
        elif current and line.startswith("    "):
            out[current] += " " + line.strip()
        else:
            current = None
    return {flag: " ".join(text.split()) for flag, text in out.items()}


def test_every_flag_has_help_and_shows_its_default():
    helps = flag_help(ServerArgs.parser().format_help())
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        text = helps[flag]
        assert text.strip(), flag
        if f.default is None or f.default is False:
            continue
        assert f"(default: {f.default})" in text or "default" in text.lower(), (flag, text)
    assert "(default: 30000)" in helps["--port"]
    assert "(default: 127.0.0.1)" in helps["--host"]
    assert "(default: 2048)" in helps["--chunked-prefill-size"]
