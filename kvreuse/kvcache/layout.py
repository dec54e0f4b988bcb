"""How a model's layers share the KV pool: groups of layers, each with its own block table per request.

A pool block holds `layers_per_block` layers' K/V for `block_size` tokens. Group 0 holds the full-attention layers
(every layer, where no layer has a sliding window or the windows' K/V are kept whole). On a model that mixes full and
sliding-window layers (Gemma 3), the sliding layers are cut into further groups of as many layers, the last one
padded, so every group's block is the same size and all groups draw from one pool (vLLM's hybrid allocator does the
same). A sliding group only keeps the blocks its window can still read, so at long contexts a sequence needs a
fraction of the full layout's memory (docs/features/sliding-window.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property

from kvreuse.config import CacheConfig, ConfigError
from kvreuse.model.args import ModelArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVGroup:
    layer_ids: tuple[int, ...]  # the model layers whose K/V it holds; layer_ids[j] sits in slot j of each block
    window: int | None = None   # keys a query reads (its own included); None: every key, kept for the whole sequence


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    layers_per_block: int

    def __post_init__(self):
        assert self.groups[0].window is None, "group 0 is the full-attention group"
        assert all(0 < len(g.layer_ids) <= self.layers_per_block for g in self.groups)
        layers = sorted(i for g in self.groups for i in g.layer_ids)
        assert layers == list(range(len(layers))), f"the groups do not cover each layer once: {layers}"

    @classmethod
    def full(cls, num_layers: int) -> KVLayout:
        """Every layer's K/V kept for the whole sequence, in one group."""
        return cls((KVGroup(tuple(range(num_layers))),), num_layers)

    @classmethod
    def of(cls, args: ModelArgs, keep_window_kv: bool = False) -> KVLayout:
        """The layout for `args`: grouped where full-attention and sliding-window layers mix, unless
        `keep_window_kv` (cache.sliding_kv = full) keeps every layer's K/V."""
        windows = [args.window(i) for i in range(args.num_layers)]
        full = tuple(i for i, w in enumerate(windows) if w is None)
        if keep_window_kv or not full or len(full) == args.num_layers:
            return cls.full(args.num_layers)  # (a model whose every layer slides keeps it all, for now)
        groups = [KVGroup(full)]
        for window in sorted({w for w in windows if w is not None}):
            sliding = [i for i, w in enumerate(windows) if w == window]
            groups += [KVGroup(tuple(sliding[a:a + len(full)]), window) for a in range(0, len(sliding), len(full))]
        return cls(tuple(groups), len(full))

    @property
    def is_grouped(self) -> bool:
        return len(self.groups) > 1

    @property
    def window_groups(self) -> tuple[KVGroup, ...]:
        return self.groups[1:]

    @cached_property
    def group_of(self) -> tuple[int, ...]:
        """The group of each model layer."""
        return tuple(g for _, g in sorted((i, g) for g, group in enumerate(self.groups) for i in group.layer_ids))

    @cached_property
    def slot_of(self) -> tuple[int, ...]:
        """Where each model layer's K/V sit in a block."""
        return tuple(j for _, j in sorted((i, j) for group in self.groups for j, i in enumerate(group.layer_ids)))

    def max_blocks_of(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """The most pool blocks one sequence of `num_tokens` tokens holds at once, all groups together, when it is
        computed `max_step_tokens` at most per step: a window group holds what the step writes and the keys before it
        that its window reads."""
        num_blocks = -(-num_tokens // block_size)
        return num_blocks + sum(min(num_blocks, -(-(g.window - 1 + max_step_tokens) // block_size) + 1)
                                for g in self.window_groups)

    def describe(self) -> str:
        if not self.is_grouped:
            return f"{len(self.groups[0].layer_ids)} layers per block"
        windows = sorted({g.window for g in self.window_groups})
        return (f"{len(self.groups)} groups of {self.layers_per_block} layers per block: 1 full attention, "
                f"{len(self.window_groups)} sliding window ({', '.join(map(str, windows))} tokens)")


def first_window_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """The first block the next token (at position `num_computed_tokens`) reads through a window of `window` keys: it
    sees positions (p - window, p]. Blocks before it are never read again by the sequence."""
    return max(0, num_computed_tokens - window + 1) // block_size


def resolve_layout(args: ModelArgs, cache: CacheConfig) -> KVLayout:
    """The pool layout `cache.sliding_kv` asks for on a model of `args`. ConfigError where `window` meets segment
    reuse, which needs every layer's K/V."""
    layout = KVLayout.of(args, keep_window_kv=cache.sliding_kv == "full" or cache.suffix.enabled)
    if cache.suffix.enabled and cache.sliding_kv != "full" and KVLayout.of(args).is_grouped:
        if cache.sliding_kv == "window":
            raise ConfigError("cache.sliding_kv = window cannot be combined with cache.suffix.enabled: segment reuse "
                              "needs every layer's K/V; use cache.sliding_kv = full or auto")
        logger.info("cache.sliding_kv = auto: full, as cache.suffix.enabled needs every layer's K/V")
    return layout
