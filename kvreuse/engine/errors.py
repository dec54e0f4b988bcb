"""`RequestError`: a request the engine refuses, raised where a request is prepared (front_end.py) or queued
(engine.py); the server answers it as the client's error, naming the field."""

from __future__ import annotations

from kvreuse.weights.tokenizer import check_unicode


class RequestError(ValueError):
    """A request the engine refuses; the message names the field and the limit. `field` is the request field it is
    about (prompt, messages, stop, cache_salt), `code` a machine-readable reason (context_length_exceeded) or None."""

    def __init__(self, message: str, field: str = "prompt", code: str | None = None):
        super().__init__(message)
        self.field, self.code = field, code


def check_text(field: str, value: object) -> None:
    """A string field hashed as UTF-8 (cache_salt, prompt_cache_key): RequestError naming it otherwise."""
    if not isinstance(value, str):
        raise RequestError(f"{field} must be a string, got {type(value).__name__}", field)
    try:
        check_unicode(value)
    except ValueError as exc:
        raise RequestError(f"{field}: {exc}", field) from None
