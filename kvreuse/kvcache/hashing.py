"""Block keys: sha256 over (parent key, token ids, extra keys), stable across processes and machines.

Extra keys hold what else decides the numbers in a block's K/V or who may see them: the model
fingerprint (weights hash, dtype), the block size and the salt (a request's, scoped by its tenant: `scoped_salt`).
A key only finds candidates; a hit is confirmed by comparing the stored token ids, so even a collision never serves
wrong KV.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Sequence

BlockHashFn = Callable[[bytes, Sequence[int], bytes], bytes]


def extra_keys(fingerprint: str, block_size: int, salt: str | None) -> bytes:
    """The per-request part of every key. Length-prefixed, so ("ab", "c") and ("a", "bc") differ."""
    parts = [fingerprint.encode(), str(block_size).encode(), (salt or "").encode()]
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


# Starts every salt that carries a tenant; a request salt starting with it is re-encoded (see scoped_salt).
SCOPED = "\x00"


def scoped_salt(tenant: str | None, salt: str | None) -> str | None:
    """The cache salt of a request carrying `salt` from `tenant` (None: a server without API keys, or the offline
    API). One salt per (tenant, salt) pair: no salt a keyless caller can send equals a tenant's, so servers with and
    without keys sharing a tier never share KV. A keyless salt not starting with SCOPED is kept as it is (the offline
    API's `cache_salt` and `kvreuse cache warm --cache-salt` give the same keys)."""
    if tenant is None and not (salt or "").startswith(SCOPED):
        return salt
    return SCOPED + json.dumps([tenant, salt])  # a JSON array: the two parts cannot run into each other


def sha256_block_key(parent_key: bytes, token_ids: Sequence[int], extra: bytes) -> bytes:
    digest = hashlib.sha256(parent_key)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(extra)
    return digest.digest()



def extend_chain(keys: list[bytes], token_ids: Sequence[int], block_size: int, extra: bytes, num_blocks: int,
                 hash_fn: BlockHashFn = sha256_block_key) -> list[bytes]:
    """Extend `keys`, the chain keys of a prompt's first full blocks, in place to its first `num_blocks`; returns it.
    The one definition of a chain: the pool, the tiers, KV events and the cluster's router all key blocks by it."""
    while len(keys) < num_blocks:
        i = len(keys)
        keys.append(hash_fn(keys[-1] if keys else b"", token_ids[i * block_size:(i + 1) * block_size], extra))
    return keys
