"""Mooncake-format request traces: read and write them, and turn a request's hash ids into prompt tokens.

One JSON object per line: `timestamp` (ms), `input_length` and `output_length` (tokens), `hash_ids` (the prompt cut
into blocks of `hash_block_tokens`, 512 in Mooncake's release; equal ids at the start of two requests mean a shared
prefix of that many blocks). A trace holds no text, so a replay makes its own tokens: hash id h becomes the block
h*N, h*N+1, ..., h*N+N-1 for N = `tokens_per_hash`: equal ids give equal blocks, different ids never do. The prompt
is its blocks' tokens, cut to `input_length` scaled by N / hash_block_tokens (rounded, and kept inside its last
block, which is full only where the trace's is), so a replay's prompt tokens are the trace's scaled and its last
block is partial as the trace's own is: never cached, as the engine caches full blocks only.
These token ids name blocks, not a model's vocabulary: only the cache simulator reads them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

MOONCAKE_HASH_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line cannot be used; the message names the file, the line and the field."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp: int               # ms from the trace's start
    input_length: int            # prompt tokens
    output_length: int           # completion tokens
    hash_ids: tuple[int, ...]    # the prompt's blocks, in order


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of the JSONL file at `path`, in file order (blank lines skipped)."""
    requests = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                requests.append(_parse(line, f"{path}:{number}"))
    return requests


def _parse(line: str, where: str) -> TraceRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object")
    values = {}
    for name in ("timestamp", "input_length", "output_length"):
        value = record.get(name, 0 if name == "output_length" else None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TraceError(f"{where}: {name} must be a non-negative integer, got {value!r}")
        values[name] = value
    hash_ids = record.get("hash_ids")
    if not isinstance(hash_ids, list) or not hash_ids or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids):
        raise TraceError(f"{where}: hash_ids must be a non-empty list of non-negative integers")
    if values["input_length"] < 1:
        raise TraceError(f"{where}: input_length must be at least 1")
    return TraceRequest(values["timestamp"], values["input_length"], values["output_length"], tuple(hash_ids))


def write_trace(path: str | Path, requests: list[TraceRequest]) -> Path:
    """Write `requests` as Mooncake JSONL (keys in Mooncake's order); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        for request in requests:
            out.write(json.dumps({**asdict(request), "hash_ids": list(request.hash_ids)}) + "\n")
    return path


def prompt_length(request: TraceRequest, tokens_per_hash: int,
                  hash_block_tokens: int = MOONCAKE_HASH_BLOCK_TOKENS) -> int:
    """The replayed prompt's length: `input_length` scaled by tokens_per_hash / hash_block_tokens, rounded, at least
    one token into its last block, and that block full only where the trace's is."""
    blocks = len(request.hash_ids)
    scaled = round(request.input_length * tokens_per_hash / hash_block_tokens)
    full = request.input_length >= blocks * hash_block_tokens
    return max((blocks - 1) * tokens_per_hash + 1, min(blocks * tokens_per_hash - (not full), scaled))


def prompt_tokens(request: TraceRequest, tokens_per_hash: int,
                  hash_block_tokens: int = MOONCAKE_HASH_BLOCK_TOKENS) -> list[int]:
    """The replayed prompt: each hash id's block of tokens, cut to `prompt_length`."""
    n = tokens_per_hash
    tokens = [t for h in request.hash_ids for t in range(h * n, h * n + n)]
    del tokens[prompt_length(request, n, hash_block_tokens):]
    return tokens
