"""Structured output: OpenAI `response_format` and vLLM's `guided_*` fields turned into grammars (xgrammar) whose
token masks keep greedy or sampled decoding inside the format. See docs/features/structured-output.md."""

from kvreuse.structured.compiler import GrammarCompiler
from kvreuse.structured.formats import CheckedFormat, FormatSpec, UnsupportedFormat, parse_format
from kvreuse.structured.grammar import CompiledGrammar, GrammarMatcher
from kvreuse.structured.masking import apply_mask

__all__ = ["CheckedFormat", "CompiledGrammar", "FormatSpec", "GrammarCompiler", "GrammarMatcher", "UnsupportedFormat",
           "apply_mask", "parse_format"]
