"""Prompt files: the JSONL that `kvreuse generate --input` and `kvreuse analyze` read.

One rule set for both:
- one JSON object per line; blank lines are skipped; plain-text lines are errors (a line that fails to parse is
  more often broken JSON than a prompt, and docs/features/offline.md documents only the JSON form);
- each object has exactly one of "prompt" (a non-empty string) or "messages" (a non-empty list of
  {"role": str, "content": str} objects, extra keys in a message allowed);
- optionally "max_tokens" (an integer) and "temperature" (a number); their ranges are checked where they are
  used (SamplingParams); analyze ignores them;
- no other fields, so a misspelt one ("max_token") is an error and not silently dropped.

Every error is a PromptsFileError whose message names the file and, for a bad line, its line number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FIELDS = ("prompt", "messages", "max_tokens", "temperature")


class PromptsFileError(ValueError):
    pass


@dataclass(frozen=True)
class PromptRecord:
    line: int
    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    temperature: float | None = None

    @property
    def text_or_messages(self) -> str | list[dict]:
        return self.prompt if self.prompt is not None else self.messages


def read_prompts_file(path: str) -> list[PromptRecord]:
    """The records of the JSONL prompt file at `path`, in file order (rules in the module docstring)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PromptsFileError(f"cannot read {path}: {exc.strerror}") from exc
    records = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                records.append(_parse_line(line, number))
            except ValueError as exc:
                raise PromptsFileError(f"{path}, line {number}: {exc}") from exc
    return records


def _parse_line(line: str, number: int) -> PromptRecord:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from exc
    if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
        raise ValueError('expected an object with exactly one of "prompt" or "messages"')
    unknown = set(record) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(FIELDS)}")
    if "prompt" in record and not (isinstance(record["prompt"], str) and record["prompt"]):
        raise ValueError('"prompt" must be a non-empty string')
    if "messages" in record and not _valid_messages(record["messages"]):
        raise ValueError('"messages" must be a non-empty list of {"role": str, "content": str} objects')
    if "max_tokens" in record and not _is_int(record["max_tokens"]):
        raise ValueError(f'"max_tokens" must be an integer, got {record["max_tokens"]!r}')
    if "temperature" in record and not (_is_int(record["temperature"]) or isinstance(record["temperature"], float)):
        raise ValueError(f'"temperature" must be a number, got {record["temperature"]!r}')
    return PromptRecord(line=number, **record)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a token count


def _valid_messages(messages) -> bool:
    return (isinstance(messages, list) and bool(messages)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages))
