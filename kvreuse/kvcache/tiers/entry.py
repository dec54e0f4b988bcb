"""The stored form of one KV block: a self-describing, checked, signed entry. Never pickle.

Layout: MAGIC (4 bytes) | format version (u16 LE) | header length (u32 LE) | header (JSON, UTF-8) | payload |
signature (32 bytes). The header names everything that decides whether the payload may be used for a request: the
chain key and the parent's, the block's token ids as their sha256 (the ids themselves only with `store_tokens`), the
model fingerprint (weights and dtype), the dtype, the block size, the payload's tensor shape and length, and an
xxh3-128 checksum of the payload (a corruption check, so that a damaged entry is told apart from a forged one). The
signature is an HMAC-SHA256, under the server's tier secret (tier_secret.py), of everything before it: whoever
lacks the secret cannot make an entry that decodes, so a tier others can write (a shared Redis) cannot feed K/V of
another prompt. `decode` checks all of them and raises InvalidEntry naming the first that fails: a bad entry is a
miss, never wrong K/V.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"KVRB"
VERSION = 2  # 2: signed, token ids as a hash by default
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
SIGNATURE_BYTES = 32
REASONS = ("truncated", "magic", "version", "header", "key", "parent", "tokens", "fingerprint", "dtype",
           "block_size", "shape", "checksum", "signature")


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


def tokens_sha256(token_ids: Sequence[int]) -> str:
    """The hex sha256 of the token ids (int64 LE): what an entry keeps of its tokens unless told to keep them."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


def encode(spec: BlockSpec, key: bytes, parent_key: bytes | None, token_ids: Sequence[int], payload, *,
           secret: bytes, store_tokens: bool = False) -> bytes:
    """One entry for the block `key` (its K/V in `payload`, any buffer of `spec.payload_bytes` bytes), signed with
    `secret`; the token ids themselves are stored only with `store_tokens` (else their sha256)."""
    data = memoryview(payload).cast("B")
    assert data.nbytes == spec.payload_bytes, f"payload of {data.nbytes} bytes, the spec says {spec.payload_bytes}"
    tokens = {"tokens": list(token_ids)} if store_tokens else {"tokens_sha256": tokens_sha256(token_ids)}
    header = {"key": key.hex(), "parent": parent_key.hex() if parent_key else "", **tokens,
              "fingerprint": spec.fingerprint, "dtype": spec.dtype, "block_size": spec.block_size,
              "shape": list(spec.shape), "payload_bytes": data.nbytes, "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
    head = json.dumps(header, separators=(",", ":")).encode()
    start = _PREFIX.pack(MAGIC, VERSION, len(head)) + head
    mac = hmac.new(secret, start, "sha256")
    mac.update(data)
    return b"".join((start, data, mac.digest()))


def decode(entry: bytes, spec: BlockSpec, key: bytes, parent_key: bytes | None, token_ids: Sequence[int], *,
           secret: bytes) -> memoryview:
    """The payload of `entry` if it is the block `key` after `parent_key` holding `token_ids`, computed by a model
    that `spec` describes, intact and signed with `secret`; else InvalidEntry."""
    view = memoryview(entry)
    header, body, end = _framing(view)
    expected = {"key": key.hex(), "parent": parent_key.hex() if parent_key else "",
                "fingerprint": spec.fingerprint, "dtype": spec.dtype, "block_size": spec.block_size,
                "shape": list(spec.shape)}
    for field, value in expected.items():
        if header.get(field) != value:
            raise InvalidEntry(field, f"{header.get(field)!r} != {value!r}"[:200])
    _check_tokens(header, token_ids)
    if end - body != spec.payload_bytes:
        raise InvalidEntry("shape", f"{end - body} payload bytes, expected {spec.payload_bytes}")
    payload = view[body:end]
    if xxhash.xxh3_128_hexdigest(payload) != header.get("xxh3_128"):
        raise InvalidEntry("checksum")
    if not hmac.compare_digest(hmac.new(secret, view[:end], "sha256").digest(), view[end:]):
        raise InvalidEntry("signature", "not signed with this server's tier key (cache.tier_secret_file): forged, "
                                        "or written by a server with another key")
    return payload


def _framing(view: memoryview) -> tuple[dict, int, int]:
    """The parsed header, where the payload starts and where it ends (the signature follows); InvalidEntry if the
    entry is not one of this format, or cut short."""
    if view.nbytes < _PREFIX.size + SIGNATURE_BYTES:
        raise InvalidEntry("truncated", f"{view.nbytes} bytes")
    magic, version, head_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise InvalidEntry("magic", repr(bytes(magic)))
    if version != VERSION:
        raise InvalidEntry("version", f"format {version}, this build reads {VERSION}")
    body = _PREFIX.size + head_len
    if view.nbytes < body + SIGNATURE_BYTES:
        raise InvalidEntry("truncated", "header cut short")
    try:
        header = json.loads(bytes(view[_PREFIX.size:body]))
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        raise InvalidEntry("header", f"not JSON: {type(exc).__name__}: {exc}"[:200]) from None
    if not isinstance(header, dict) or not all(map(_flat, header.values())):
        raise InvalidEntry("header", "not a JSON object of strings, integers and lists of integers")
    try:
        payload_bytes = int(header["payload_bytes"])
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidEntry("header", f"payload_bytes: {type(exc).__name__}: {exc}"[:200]) from None
    if view.nbytes != body + payload_bytes + SIGNATURE_BYTES:
        raise InvalidEntry("truncated", f"{view.nbytes - body - SIGNATURE_BYTES} payload bytes, the header says "
                                        f"{payload_bytes}")
    return header, body, body + payload_bytes


def _flat(value) -> bool:
    """A header value as `encode` writes them: a string, an integer or a list of integers (nothing nested, so that
    comparing and naming it in a message stay cheap)."""
    return isinstance(value, str | int) or (isinstance(value, list) and all(isinstance(v, int) for v in value))


def _check_tokens(header: dict, token_ids: Sequence[int]) -> None:
    """The header's tokens (the ids, or their sha256) are `token_ids`, else InvalidEntry("tokens")."""
    if "tokens" in header:
        if header["tokens"] != list(token_ids):
            raise InvalidEntry("tokens", f"{header['tokens']!r} != {list(token_ids)!r}"[:200])
    elif header.get("tokens_sha256") != tokens_sha256(token_ids):
        raise InvalidEntry("tokens", "the sha256 of the token ids differs")
