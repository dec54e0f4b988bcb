"""The INI side of the config: `load_config` reads defaults, then a file (the article's keys as written, multi-line
or flattened on one line), then `--set section.key=value` overrides, a preset's keys first; `config_to_ini` writes
a Config back. Text is converted per key (`parse_value`) and checked by the sections."""

from __future__ import annotations

import configparser
import contextlib
import os
import re
from collections.abc import Sequence
from functools import reduce

from pydantic import ConfigDict, TypeAdapter, ValidationError

from kvreuse.config.messages import MUST_BE, ConfigError, message, unknown
from kvreuse.config.presets import PRESETS
from kvreuse.config.sections import KEYS, Config, reported

_NUMBERS = {kind: TypeAdapter(kind, config=ConfigDict(allow_inf_nan=False)) for kind in (int, float)}


def parse_value(key: str, text: str, kind: type) -> bool | int | float | str:
    """Convert the INI text of ``key`` (e.g. ``'cache.block_size'``) to ``kind``, or raise ConfigError.

    Booleans take configparser's spellings (true/false, yes/no, on/off, 1/0, any case); numbers must be finite."""
    if kind is str:
        return text
    if kind is bool:
        with contextlib.suppress(KeyError):
            return configparser.ConfigParser.BOOLEAN_STATES[text.strip().lower()]
        raise ConfigError(f"config key '{key}' must be {MUST_BE['bool_type']}, got {text!r}")
    try:
        return _NUMBERS[kind].validate_strings(text)
    except ValidationError as exc:
        raise ConfigError(message(KEYS, key, exc.errors()[0])) from None


_HEADER_WITH_KEYS = re.compile(r"\s*\[[^\]]*\]\s*[^\s#;]")
_HEADER = re.compile(r"\s*(\[[^\]]*\])\s*")
_PAIR = re.compile(r"([^\s=]+)\s*=\s*(\S+)")
_TRAILING_COMMENT = re.compile(r"\s[#;].*")


def _unflatten(text: str, name: str) -> tuple[str, list[int]]:
    # The article printed its example on one line ("[server] max_tokens = 2048 [cache] enabled = true ...");
    # configparser would silently take "[server] max_tokens ..." as a header, so split such lines first.
    # Returns the text and, for each output line, its line number in the original file.
    lines: list[str] = []
    origin: list[int] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not _HEADER_WITH_KEYS.match(line):
            lines.append(line)
            origin.append(number)
            continue
        for part in _HEADER.split(_TRAILING_COMMENT.sub("", line)):
            if part.startswith("["):
                lines.append(part)
                origin.append(number)
                continue
            leftover = _PAIR.sub("", part).strip()
            if leftover:
                raise ConfigError(
                    f"malformed config file {name}, line {number}: expected key = value, got {leftover!r}"
                )
            for key, value in _PAIR.findall(part):
                lines.append(f"{key} = {value}")
                origin.append(number)
    return "\n".join(lines) + "\n", origin


def _syntax_error(exc: configparser.Error, name: str, text: str, origin: list[int]) -> ConfigError:
    lines = text.split("\n")

    def line(n: int) -> int:
        return origin[n - 1] if 0 < n <= len(origin) else n

    where = f"malformed config file {name}"
    if isinstance(exc, configparser.MissingSectionHeaderError):
        bad = exc.line.strip()
        return ConfigError(f"{where}, line {line(exc.lineno)}: expected a [section] header, got {bad!r}")
    if isinstance(exc, configparser.ParsingError):
        lineno = exc.errors[0][0]
        bad = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
        return ConfigError(f"{where}, line {line(lineno)}: expected key = value or [section], got {bad!r}")
    if isinstance(exc, configparser.DuplicateOptionError):
        return ConfigError(f"{where}, line {line(exc.lineno)}: key '{exc.section}.{exc.option}' is set twice")
    if isinstance(exc, configparser.DuplicateSectionError):
        return ConfigError(f"{where}, line {line(exc.lineno)}: section [{exc.section}] appears twice")
    return ConfigError(f"{where}: {exc}")


def _read_file(path: str | os.PathLike) -> tuple[str, configparser.ConfigParser]:
    name = str(os.fspath(path))
    try:
        with open(name, encoding="utf-8-sig") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {name}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {name}: {exc}") from None
    text, origin = _unflatten(text, name)
    # An unmatchable default section makes a stray [DEFAULT] an unknown section instead of leaking its keys
    # into every section; no interpolation so values may contain '%'.
    parser = configparser.ConfigParser(interpolation=None, default_section="\0")
    try:
        parser.read_string(text, source=name)
    except configparser.Error as exc:
        raise _syntax_error(exc, name, text, origin) from None
    return name, parser


def _parse_override(item: str) -> tuple[str, str, str]:
    name, eq, text = item.partition("=")
    section, dot, key = name.strip().partition(".")
    section, key = section.strip(), key.strip().lower()
    if not eq or not dot or not section or not key:
        raise ConfigError(f"bad --set {item!r}: expected section.key=value")
    return section, key, text.strip()


def _assign(values: dict, section: str, key: str, text: str, where: str) -> None:
    """Parse ``text`` for ``section.key`` into the nested dict ``values`` (``suffix.mode`` under ``suffix``)."""
    fields = KEYS.get(section, {})
    if key not in fields:
        raise ConfigError(unknown(KEYS, section, key, where))
    kind = fields[key].annotation
    value = parse_value(f"{section}.{key}", text, kind if kind in (bool, int, float) else str)
    *parents, name = key.split(".")
    node = values.setdefault(section, {})
    for parent in parents:
        node = node.setdefault(parent, {})
    node[name] = value


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults, then the INI file at ``path`` (if any), then ``section.key=value`` overrides; validated.

    Raises ConfigError with a one-sentence message for any unreadable, unknown or invalid setting.
    """
    assignments: list[tuple[str, str, str, str]] = []  # (section, key, text, where), file first, then --set
    if path is not None:
        name, parser = _read_file(path)
        for section in parser.sections():
            if section not in KEYS:
                raise ConfigError(unknown(KEYS, section, "", f"in {name}"))
            assignments += [(section, key, text, f"in {name}") for key, text in parser.items(section, raw=True)]
    if isinstance(overrides, str):
        overrides = [overrides]
    for item in overrides:
        assignments.append((*_parse_override(item), f"in --set {item!r}"))
    values: dict = {}
    presets = [a for a in assignments if a[:2] == ("cache", "preset")]
    if presets:
        _assign(values, *presets[-1])
        preset = values["cache"]["preset"]
        for key, text in PRESETS.get(preset, {}).items():  # an unknown preset fails validation below
            _assign(values, "cache", key, text, f"in preset {preset!r}")
    for assignment in assignments:
        _assign(values, *assignment)
    with reported(Config):
        return Config.model_validate(values)


def _format(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def config_to_ini(config: Config) -> str:
    """Every key of every section as INI text that ``load_config`` reads back to an equal Config.

    String values are written verbatim, so they must not hold newlines or leading/trailing spaces.
    """
    lines: list[str] = []
    for section, keys in KEYS.items():
        lines.append(f"[{section}]")
        for key in keys:
            value = reduce(getattr, key.split("."), getattr(config, section))
            lines.append(f"{key} = {_format(value)}".rstrip())
        lines.append("")
    return "\n".join(lines)
