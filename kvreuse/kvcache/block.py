"""One physical KV block and what the cache knows about its contents."""

from __future__ import annotations

from dataclasses import dataclass

# The pool's reserved block (BlockPool): never allocated, held, freed, evicted or published. A sliding window's table
# holds it where the window has passed a block, and attention pads ragged tables with it; what it holds is never read
# unmasked.
NULL_BLOCK = 0


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0                          # requests holding this block
    block_key: bytes | None = None            # prefix-chain key, set once the block is fully computed
    token_ids: tuple[int, ...] | None = None  # its tokens, to confirm a key hit
    uid: int | None = None                    # identity of the published contents, never reused; None: unpublished
    parent_uid: int | None = None             # uid of the block before it in its sequence; None: the first block
    num_hits: int = 0                         # times reused (LFU)
    last_access: int = 0                      # pool tick of the last allocate / hit / free (LRU among equals)
    position: int = 0                         # absolute position of its first token when it was computed
    extra_key: bytes = b""                    # fingerprint, block size, salt of the request that computed it
    group: int = 0                            # the layout group whose K/V it holds (kvcache/layout.py), once published

    def reset(self) -> None:
        self.block_key = self.token_ids = self.uid = self.parent_uid = None
        self.num_hits = self.position = self.group = 0
        self.extra_key = b""
