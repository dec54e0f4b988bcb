"""Structured output: OpenAI `response_format` and vLLM's `guided_*` fields turned into grammars (xgrammar) whose
token masks keep greedy or sampled decoding inside the format. See docs/features/structured-output.md."""

from kvreuse.structured.formats import FormatSpec, UnsupportedFormat, parse_format
from kvreuse.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarMatcher
from kvreuse.structured.masking import apply_mask

__all__ = ["CompiledGrammar", "FormatSpec", "GrammarCompiler", "GrammarMatcher", "UnsupportedFormat", "apply_mask",
           "parse_format"]
