"""Pinned prefixes: chains of cached blocks held in the pool on purpose (`POST /cache/warm` with `pin`), so no eviction
policy takes them while they last.

A pin holds one reference to each of its blocks, as a request would; it ends at its expiry (`cache.pin_ttl_s` or the
warm request's own TTL; None: until unpinned) or when every pin is dropped (`POST /cache/unpin`). Pins together never
hold more than `max_blocks` distinct blocks (`cache.pin_max_share` of the pool): a pin that would is refused, not cut,
since a cut chain (under sliding windows, one without its last window) could not be hit as pinned. Pinning the same
chain again replaces its pin (a new expiry), so references never pile up."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvreuse.kvcache.block_pool import BlockPool


@dataclass(frozen=True)
class Pin:
    block_ids: tuple[int, ...]   # the chain's blocks, every layer group's (each holds one reference of this pin)
    num_tokens: int              # prompt tokens the chain covers
    expires_at: float | None     # time.monotonic() at which it ends; None: until unpinned


@dataclass(frozen=True)
class PinResult:
    """What pinning a prompt did: the prompt tokens its pinned chain covers, or why nothing was pinned."""
    pinned_tokens: int
    refused: str | None = None


class Pins:
    def __init__(self, pool: BlockPool, max_blocks: int):
        self.pool, self.max_blocks = pool, max_blocks
        self.pins: dict[bytes, Pin] = {}  # by the chain key of the pinned chain's last block

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held by the pins."""
        return len({b for pin in self.pins.values() for b in pin.block_ids})

    def num_new_blocks(self, key: bytes, block_ids: Sequence[int]) -> int:
        """How many more distinct blocks the pins would hold with `block_ids` pinned under `key`."""
        others = {b for k, pin in self.pins.items() if k != key for b in pin.block_ids}
        return len(others | set(block_ids)) - self.num_blocks

    def can_pin(self, key: bytes, block_ids: Sequence[int]) -> bool:
        return self.num_blocks + self.num_new_blocks(key, block_ids) <= self.max_blocks

    def pin(self, key: bytes, block_ids: Sequence[int], num_tokens: int, expires_at: float | None) -> None:
        assert self.can_pin(key, block_ids), "over the pins' share of the pool"
        self.pool.hold(block_ids)  # first: the blocks of a replaced pin may be these
        old = self.pins.pop(key, None)
        if old is not None:
            self.pool.free(old.block_ids)
        self.pins[key] = Pin(tuple(block_ids), num_tokens, expires_at)

    def expire(self, now: float) -> int:
        """End the pins whose time is past; how many."""
        ended = [k for k, pin in self.pins.items() if pin.expires_at is not None and pin.expires_at <= now]
        for key in ended:
            self.pool.free(self.pins.pop(key).block_ids)
        return len(ended)

    def unpin_all(self) -> int:
        """End every pin; how many blocks they held."""
        num_blocks = self.num_blocks
        for pin in self.pins.values():
            self.pool.free(pin.block_ids)
        self.pins.clear()
        return num_blocks

    def held_block_ids(self) -> list[int]:
        """Every reference the pins hold, one entry per pin and block (for the manager's integrity check)."""
        return [b for pin in self.pins.values() for b in pin.block_ids]

    def check_integrity(self) -> None:
        assert self.num_blocks <= self.max_blocks, f"pins hold {self.num_blocks} blocks, over {self.max_blocks}"
        for key, pin in self.pins.items():
            for block_id in pin.block_ids:
                block = self.pool.blocks[block_id]
                assert block.block_key is not None and block.ref_cnt > 0, \
                    f"pinned block {block_id} ({key.hex()[:8]}) is not a held cached block"

    def snapshot(self, now: float) -> dict:
        return {"num_pins": len(self.pins), "blocks": self.num_blocks, "max_blocks": self.max_blocks,
                "tokens": sum(p.num_tokens for p in self.pins.values()),
                "next_expiry_s": min((p.expires_at - now for p in self.pins.values() if p.expires_at is not None),
                                     default=None)}
