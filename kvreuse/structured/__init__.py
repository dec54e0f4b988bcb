"""Structured output: OpenAI `response_format` and vLLM's `guided_*` fields turned into grammars (xgrammar) whose
token masks keep greedy or sampled decoding inside the format. See docs/features/structured-output.md.

The names below are imported on first use: xgrammar imports transformers (~0.5 s), which a server without a
format request never needs at start, and a submodule (`errors`) must not pull it in."""

import importlib

_HOMES = {"GrammarCompiler": "compiler", "CheckedFormat": "formats", "FormatSpec": "formats",
          "UnsupportedFormat": "formats", "parse_format": "formats", "CompiledGrammar": "grammar",
          "GrammarMatcher": "grammar"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvreuse.structured.{_HOMES[name]}"), name)
