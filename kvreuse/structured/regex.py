"""Regular expressions as the grammar engine reads them."""

from __future__ import annotations

from kvreuse.extras import MissingExtraError
from kvreuse.structured.errors import engine_message, grammar_engine


def regex_problem(pattern: object) -> str | None:
    """Why the engine cannot enforce `pattern` (not a string, a syntax error, a lookaround, a word boundary), or None.
    Parsing alone, without a tokenizer: tens of microseconds. A schema's `pattern` goes through here too because
    inside a schema the engine only warns about a lookaround and then ignores it."""
    if not isinstance(pattern, str):
        return f"must be a string, not {type(pattern).__name__}"
    try:
        xgr = grammar_engine()
    except MissingExtraError as exc:
        return str(exc)
    try:
        xgr.Grammar.from_regex(pattern)
    except Exception as exc:  # xgrammar raises RuntimeError (and may raise others) for what it cannot parse
        return engine_message(exc)
    return None
