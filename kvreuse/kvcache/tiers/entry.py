"""The stored form of one KV block: a self-describing, checked entry. Never pickle.

Layout: MAGIC (4 bytes) | format version (u16 LE) | header length (u32 LE) | header (JSON, UTF-8) | payload.
The header names everything that decides whether the payload may be used for a request: the chain key and the
parent's, the block's token ids, the model fingerprint (weights and dtype), the dtype, the block size, the payload's
tensor shape and length, and an xxh3-128 checksum of the payload (a corruption check, 5 ms for 47 MB; keys are
sha256, so identity does not rest on it). `decode` checks all of them and raises InvalidEntry naming the first that
fails: a bad entry is a miss, never wrong K/V.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"KVRB"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
REASONS = ("truncated", "magic", "version", "header", "key", "parent", "tokens", "fingerprint", "dtype",
           "block_size", "shape", "checksum")


class InvalidEntry(ValueError):
    """An entry that must not be used; `reason` is one of REASONS (a metric label)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class BlockSpec:
    """What every block of this engine is: the same for all its entries (its dtype name is torch's, "bfloat16")."""

    fingerprint: str
    dtype: str
    block_size: int
    shape: tuple[int, ...]   # one block's K/V: [num_layers, 2, block_size, num_kv_heads, head_dim]
    itemsize: int

    @property
    def payload_bytes(self) -> int:
        n = self.itemsize
        for dim in self.shape:
            n *= dim
        return n


def encode(spec: BlockSpec, key: bytes, parent_key: bytes | None, token_ids: Sequence[int], payload) -> bytes:
    """One entry for the block `key` (its K/V in `payload`, any buffer of `spec.payload_bytes` bytes)."""
    data = memoryview(payload).cast("B")
    assert data.nbytes == spec.payload_bytes, f"payload of {data.nbytes} bytes, the spec says {spec.payload_bytes}"
    header = {"key": key.hex(), "parent": parent_key.hex() if parent_key else "", "tokens": list(token_ids),
              "fingerprint": spec.fingerprint, "dtype": spec.dtype, "block_size": spec.block_size,
              "shape": list(spec.shape), "payload_bytes": data.nbytes, "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join((_PREFIX.pack(MAGIC, VERSION, len(head)), head, data))


def decode(entry: bytes, spec: BlockSpec, key: bytes, parent_key: bytes | None,
           token_ids: Sequence[int]) -> memoryview:
    """The payload of `entry` if it is the block `key` after `parent_key` holding `token_ids`, computed by a model
    that `spec` describes, and intact; else InvalidEntry."""
    view = memoryview(entry)
    if view.nbytes < _PREFIX.size:
        raise InvalidEntry("truncated", f"{view.nbytes} bytes")
    magic, version, head_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise InvalidEntry("magic", repr(bytes(magic)))
    if version != VERSION:
        raise InvalidEntry("version", f"format {version}, this build reads {VERSION}")
    body = _PREFIX.size + head_len
    if view.nbytes < body:
        raise InvalidEntry("truncated", "header cut short")
    try:
        header = json.loads(bytes(view[_PREFIX.size:body]))
        payload_bytes = int(header["payload_bytes"])
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidEntry("header", str(exc)) from None
    if view.nbytes != body + payload_bytes:
        raise InvalidEntry("truncated", f"{view.nbytes - body} payload bytes, the header says {payload_bytes}")
    expected = {"key": key.hex(), "parent": parent_key.hex() if parent_key else "", "tokens": list(token_ids),
                "fingerprint": spec.fingerprint, "dtype": spec.dtype, "block_size": spec.block_size,
                "shape": list(spec.shape)}
    for field, value in expected.items():
        if header.get(field) != value:
            raise InvalidEntry(field, f"{header.get(field)!r} != {value!r}"[:200])
    if payload_bytes != spec.payload_bytes:
        raise InvalidEntry("shape", f"{payload_bytes} payload bytes, expected {spec.payload_bytes}")
    payload = view[body:]
    if xxhash.xxh3_128_hexdigest(payload) != header.get("xxh3_128"):
        raise InvalidEntry("checksum")
    return payload
