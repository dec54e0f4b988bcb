"""The one error structured output raises for a request it cannot serve, and whether it can serve any."""

from __future__ import annotations

import re

from kvreuse.extras import MissingExtraError, require

STRUCTURED_OUTPUT = "structured output (response_format, guided_*, tool calls)"

# xgrammar's C++ errors start with "[hh:mm:ss] /project/cpp/file.cc:123: ": noise to a client.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+\.(?:cc|h):[0-9]+: (?:Check failed: )?")


class UnsupportedFormat(ValueError):
    """A structured-output request that is malformed or asks for something the grammar engine cannot enforce.
    `field` is the request field at fault ("response_format", "guided_regex", "guided_choice", "guided_json")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # picklable with both arguments (it may cross a process boundary)
        return type(self), (self.field, str(self))


def grammar_engine():
    """xgrammar, the grammar engine (imported on first use: ~0.5 s), or MissingExtraError naming the command that
    installs it."""
    return require("xgrammar", "structured", STRUCTURED_OUTPUT)


def engine_missing() -> str | None:
    """Why this server can enforce no format (xgrammar is not installed; the message names the fix), or None."""
    try:
        grammar_engine()
    except MissingExtraError as exc:
        return str(exc)
    return None


def engine_message(exc: Exception) -> str:
    """An xgrammar exception's text without its C++ source location."""
    return _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
