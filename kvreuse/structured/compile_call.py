"""The one xgrammar call that compiles each kind of FormatSpec, made alike here and in the check process.

Output is compact: one line, separators ", " and ": ", no free whitespace. Free whitespace lets a small model
spend its whole budget on newlines before the first key; a fixed layout also makes outputs shorter and repeatable.
"""

from __future__ import annotations

import json
import os

import xgrammar as xgr

from kvreuse.structured.formats import FormatSpec
from kvreuse.structured.tool_grammar import compile_tool_calls

COMPILE_THREADS = min(4, os.cpu_count() or 1)  # xgrammar's threads for one compile


def compile_format(compiler: xgr.GrammarCompiler, spec: FormatSpec) -> xgr.CompiledGrammar:
    """`spec` compiled by `compiler`; xgrammar raises (RuntimeError, and may raise others) for what it refuses."""
    if spec.kind == "json_object":
        # Any object, any properties: strict mode would allow declared properties only, i.e. none.
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if spec.kind == "json_schema":
        # Strict mode: no properties beyond the declared ones (a valid subset of what the schema allows).
        return compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.value)
    if spec.kind == "choice":
        # JSON string literals are EBNF string literals (ensure_ascii=False: xgrammar reads raw UTF-8).
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec.value))
        return compiler.compile_grammar(f"root ::= {alternatives}")
    if spec.kind == "tool_calls":
        return compile_tool_calls(compiler, spec.value)
    raise ValueError(f"unknown format kind {spec.kind!r}")


def new_compiler(info: xgr.TokenizerInfo) -> xgr.GrammarCompiler:
    """A compiler without xgrammar's own cache (the GrammarCompiler keeps one, bounded by bytes)."""
    return xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
