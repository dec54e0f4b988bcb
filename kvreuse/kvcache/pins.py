"""Pinned prefixes: chains of cached blocks held in the pool on purpose (`POST /cache/warm` with `pin`), so no eviction
policy takes them while they last.

A pin holds one reference to each of its blocks, as a request would; it ends at its expiry (`cache.pin_ttl_s` or the
warm request's own TTL; None: until unpinned) or when every pin is dropped (`POST /cache/unpin`). Pins together never
hold more than `max_blocks` distinct blocks (`cache.pin_max_share` of the pool), and each tenant's pins never more than
its own share of them: `max_blocks` split evenly among the server's tenants (the tenants its API keys name, admins
included; a server without keys, or an offline engine, is one tenant with all of it). The tenants' shares add up to
at most `max_blocks`, so a tenant below its share can always pin that much, whatever the others pinned: one tenant's
pins never shut another out. A pin that would go over either bound is refused, not cut, since a cut chain (under
sliding windows, one without its last window) could not be hit as pinned. Pinning the same chain again (the same
tenant) replaces its pin (a new expiry), so references never pile up."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvreuse.kvcache.block_pool import BlockPool


@dataclass(frozen=True)
class Pin:
    block_ids: tuple[int, ...]   # the chain's blocks, every layer group's (each holds one reference of this pin)
    num_tokens: int              # prompt tokens the chain covers
    expires_at: float | None     # time.monotonic() at which it ends; None: until unpinned
    tenant: str | None = None    # whose pin it is (None: a server without API keys, or an offline engine)


@dataclass(frozen=True)
class PinResult:
    """What pinning a prompt did: the prompt tokens its pinned chain covers, or why nothing was pinned."""
    pinned_tokens: int
    refused: str | None = None


class Pins:
    def __init__(self, pool: BlockPool, max_blocks: int):
        self.pool, self.max_blocks = pool, max_blocks
        self.pins: dict[tuple[str | None, bytes], Pin] = {}  # by tenant and the chain key of the chain's last block
        # Each tenant holding pins: the most blocks its pins may hold, as last granted (tenant_max_blocks).
        self.tenant_caps: dict[str | None, int] = {}

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held by the pins."""
        return len({b for pin in self.pins.values() for b in pin.block_ids})

    def tenant_max_blocks(self, num_tenants: int) -> int:
        """The most distinct blocks one tenant's pins may hold when the share is split among `num_tenants`."""
        return self.max_blocks // max(1, num_tenants)

    def tenant_blocks(self, tenant: str | None) -> int:
        """Distinct blocks held by `tenant`'s pins."""
        return len({b for pin in self.pins.values() if pin.tenant == tenant for b in pin.block_ids})

    def _with(self, tenant: str | None, key: bytes, block_ids: Sequence[int]) -> tuple[int, int]:
        """Distinct blocks the pins would hold with `block_ids` pinned under `key` for `tenant`: in all, and the
        tenant's."""
        others = [pin for k, pin in self.pins.items() if k != (tenant, key)]
        total = {b for pin in others for b in pin.block_ids} | set(block_ids)
        own = {b for pin in others if pin.tenant == tenant for b in pin.block_ids} | set(block_ids)
        return len(total), len(own)

    def can_pin(self, key: bytes, block_ids: Sequence[int], tenant: str | None = None, num_tenants: int = 1) -> bool:
        """`block_ids` pinned under `key` for `tenant` (one of `num_tenants`) stay within both bounds."""
        total, own = self._with(tenant, key, block_ids)
        return total <= self.max_blocks and own <= self.tenant_max_blocks(num_tenants)

    def refusal(self, tenant: str | None, num_tenants: int, share: str) -> str:
        """Why a pin was refused (`can_pin` was False): the bound it would pass, named by `share` (the setting, as
        `cache.pin_max_share = 0.25`), and what is pinned."""
        if tenant is None and num_tenants <= 1:
            return f"the pins would hold more than {share} of the pool ({self.max_blocks} blocks; " \
                   f"{self.num_blocks} pinned)"
        return (f"tenant {tenant!r}'s pins would hold more than its share of the pool: {share} split among "
                f"{num_tenants} tenants, {self.tenant_max_blocks(num_tenants)} blocks each of {self.max_blocks} "
                f"({tenant!r} pins {self.tenant_blocks(tenant)}; {self.num_blocks} pinned in all)")

    def pin(self, key: bytes, block_ids: Sequence[int], num_tokens: int, expires_at: float | None,
            tenant: str | None = None, num_tenants: int = 1) -> None:
        """Pin `block_ids` (a chain whose last block's key is `key`) for `tenant`; `can_pin` said yes."""
        assert self.can_pin(key, block_ids, tenant, num_tenants), "over the pins' share of the pool"
        self.pool.hold(block_ids)  # first: the blocks of a replaced pin may be these
        old = self.pins.pop((tenant, key), None)
        if old is not None:
            self.pool.free(old.block_ids)
        self.pins[tenant, key] = Pin(tuple(block_ids), num_tokens, expires_at, tenant)
        self.tenant_caps[tenant] = self.tenant_max_blocks(num_tenants)

    def expire(self, now: float) -> int:
        """End the pins whose time is past; how many."""
        ended = [k for k, pin in self.pins.items() if pin.expires_at is not None and pin.expires_at <= now]
        for key in ended:
            self.pool.free(self.pins.pop(key).block_ids)
        self._forget_tenants()
        return len(ended)

    def unpin_all(self) -> int:
        """End every pin, every tenant's; how many blocks they held."""
        num_blocks = self.num_blocks
        for pin in self.pins.values():
            self.pool.free(pin.block_ids)
        self.pins.clear()
        self._forget_tenants()
        return num_blocks

    def _forget_tenants(self) -> None:
        """Drop the caps of tenants that hold no pin."""
        holding = {pin.tenant for pin in self.pins.values()}
        self.tenant_caps = {t: cap for t, cap in self.tenant_caps.items() if t in holding}

    def held_block_ids(self) -> list[int]:
        """Every reference the pins hold, one entry per pin and block (for the manager's integrity check)."""
        return [b for pin in self.pins.values() for b in pin.block_ids]

    def check_integrity(self) -> None:
        """Within both bounds, each tenant's caps adding up to at most the pins' share, each pin filed under its own
        tenant, and each pinned block a held cached block."""
        assert self.num_blocks <= self.max_blocks, f"pins hold {self.num_blocks} blocks, over {self.max_blocks}"
        assert set(self.tenant_caps) == {pin.tenant for pin in self.pins.values()}, "caps of tenants without pins"
        # What keeps one tenant from shutting another out: the caps of the tenants that pin fit the share together.
        assert sum(self.tenant_caps.values()) <= self.max_blocks, \
            f"tenant caps {self.tenant_caps} add up to more than {self.max_blocks}"
        for tenant, cap in self.tenant_caps.items():
            assert self.tenant_blocks(tenant) <= cap, f"tenant {tenant!r} pins {self.tenant_blocks(tenant)} blocks, " \
                                                      f"over its {cap}"
        for (tenant, key), pin in self.pins.items():
            assert pin.tenant == tenant, f"pin {key.hex()[:8]} of {pin.tenant!r} filed under {tenant!r}"
            for block_id in pin.block_ids:
                block = self.pool.blocks[block_id]
                assert block.block_key is not None and block.ref_cnt > 0, \
                    f"pinned block {block_id} ({key.hex()[:8]}) is not a held cached block"

    def snapshot(self, now: float) -> dict:
        """What GET /cache/stats shows: counts in all, and the blocks each named tenant's pins hold out of its cap."""
        return {"num_pins": len(self.pins), "blocks": self.num_blocks, "max_blocks": self.max_blocks,
                "tokens": sum(p.num_tokens for p in self.pins.values()),
                "next_expiry_s": min((p.expires_at - now for p in self.pins.values() if p.expires_at is not None),
                                     default=None),
                "tenants": {t: {"blocks": self.tenant_blocks(t), "max_blocks": cap}
                            for t, cap in self.tenant_caps.items() if t is not None}}
