"""Config errors: `ConfigError`, and the one sentence each names the key, the value and what is allowed with, or
for an unknown section or key the closest valid name ("did you mean").

The functions take the INI key table (`sections.KEYS`) as an argument, so that the sections can report their
own errors through them without a circle."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import get_args

from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

Keys = Mapping[str, Mapping[str, FieldInfo]]  # section -> INI key ("suffix.enabled") -> its field


class ConfigError(ValueError):
    """A config file, override or value is invalid; the message names the key or line and the problem."""


# What a value must be, by pydantic error type.
MUST_BE = {"bool_type": "a boolean (true/false)", "string_type": "a string",
           **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "an integer"),
           **dict.fromkeys(("float_type", "float_parsing", "finite_number"), "a number")}


def unknown(keys: Keys, section: str, key: str, where: str) -> str:
    """The message for an unknown section, or for an unknown key of a known one, with the closest valid name."""
    if section not in keys:
        valid = sorted(keys)
        close = difflib.get_close_matches(section, valid, n=1)
        hint = f"; did you mean [{close[0]}]?" if close else ";"
        return f"unknown config section [{section}] {where}{hint} valid sections: {', '.join(valid)}"
    fields = keys[section]
    close = difflib.get_close_matches(key, list(fields), n=1)
    hint = f"did you mean '{section}.{close[0]}'?" if close else f"valid keys: {', '.join(sorted(fields))}"
    return f"unknown config key '{section}.{key}'; {hint}"


def message(keys: Keys, key: str, error: ErrorDetails) -> str:
    """The one sentence for pydantic's `error` about the INI key `key` (`cache.block_size`): the key, the value and
    what is allowed."""
    kind, got = error["type"], error["input"]
    section, _, rest = key.partition(".")
    field = keys.get(section, {}).get(rest)
    if kind in MUST_BE:
        return f"config key '{key}' must be {MUST_BE[kind]}, got {got!r}"
    if kind == "literal_error" and field is not None:
        return f"config key '{key}' must be one of {', '.join(get_args(field.annotation))}, got {got!r}"
    if kind in ("greater_than_equal", "less_than_equal") and field is not None:
        low = next((m.ge for m in field.metadata if hasattr(m, "ge")), None)
        high = next((m.le for m in field.metadata if hasattr(m, "le")), None)
        if low is not None and high is not None:
            return f"config key '{key}' must be between {low} and {high}, got {got}"
        bound = f">= {error['ctx']['ge']}" if kind == "greater_than_equal" else f"<= {error['ctx']['le']}"
        return f"config key '{key}' must be {bound}, got {got}"
    if kind == "string_pattern_mismatch" and key == "cache.redis.url":
        return f"config key '{key}' must be a redis://host:port/db (or rediss://, unix://) URL, got {got!r}"
    if kind == "string_pattern_mismatch" and key.startswith("events."):
        return f"config key '{key}' must be a ZMQ endpoint such as tcp://127.0.0.1:5557, got {got!r}"
    if kind == "greater_than":
        return f"config key '{key}' must be > {error['ctx']['gt']}, got {got}"
    if kind == "extra_forbidden":
        return unknown(keys, section, rest, "in code")
    if kind == "value_error":
        return f"config key '{key}': {error['ctx']['error']}, got {got!r}"
    if kind == "frozen_instance":
        return f"config key '{key}' is read-only, got {got!r}; derive a changed copy with with_changes()"
    return f"config key '{key}': {error['msg']}, got {got!r}"
