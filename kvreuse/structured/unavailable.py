"""The grammar compiler of a server without xgrammar: it starts and serves free text, and refuses every format."""

from __future__ import annotations

from kvreuse.structured.errors import UnsupportedFormat


class NoGrammarEngine:
    """Stands in for the GrammarCompiler where xgrammar is not installed: `check` and `compile` refuse every format
    (400 naming the request field, and `why`: the command that installs xgrammar)."""

    def __init__(self, why: str):
        self.why = why

    def check(self, fmt) -> None:
        spec = getattr(fmt, "spec", fmt)  # a CheckedFormat holds its FormatSpec
        raise UnsupportedFormat(spec.field, f"{spec.field}: {self.why}")

    compile = check

    def close(self) -> None:
        pass
