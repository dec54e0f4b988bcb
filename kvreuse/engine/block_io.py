"""The KV pool's blocks as bytes, for the tiers under it (kvcache/tiers/store.py's BlockIO).

An entry holds one position's K/V of every model layer, in the model's layer order, whatever the pool's layout
(kvcache/layout.py): a grouped pool gathers a position from its blocks in every group, so engines with either
`cache.sliding_kv` read each other's entries. A one-group pool copies block by block: a strided block of the pool to
or from a contiguous buffer in one copy each (a gather-then-permute costs two; measured 15 vs 27 ms to read, 8 vs 18
ms to write 128 bf16 blocks)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvreuse.kvcache.layout import KVLayout
from kvreuse.kvcache.tiers.entry import BlockSpec


class PoolBlockIO:
    def __init__(self, kv_cache: torch.Tensor, fingerprint: str, layout: KVLayout | None = None):
        self.kv_cache = kv_cache  # [layers_per_block, K/V, num_blocks, block_size, num_kv_heads, head_dim]
        layers_per_block, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        self.layout = layout or KVLayout.full(layers_per_block)
        # Each group's model layers, and how many slots of its blocks they fill.
        self._layers = [list(g.layer_ids) for g in self.layout.groups]
        num_layers = sum(map(len, self._layers))
        self.block_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)  # one entry's K/V, model layer order
        self.spec = BlockSpec(fingerprint, str(kv_cache.dtype).removeprefix("torch."), block_size, self.block_shape,
                              kv_cache.dtype.itemsize)
        # On the CPU, the pool's bytes as a numpy view: loaded entries (read-only bytes) are copied straight in.
        self._pool_bytes = kv_cache.view(torch.uint8).numpy() if kv_cache.device.type == "cpu" else None

    def read(self, positions: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
        """Each position's K/V (its block in every group, group 0 first) as one contiguous host array of bytes."""
        out = torch.empty(len(positions), *self.block_shape, dtype=self.kv_cache.dtype)  # [n, L, 2, bs, H, D]
        for j, block_ids in enumerate(positions):
            if not self.layout.is_grouped:
                out[j].copy_(self.kv_cache[:, :, block_ids[0]])
                continue
            for layers, block_id in zip(self._layers, block_ids, strict=True):
                out[j, layers] = self.kv_cache[:len(layers), :, block_id].to("cpu")
        return list(out.view(torch.uint8).reshape(len(positions), -1).numpy())

    def write(self, positions: Sequence[tuple[int, ...]], payloads: Sequence) -> None:
        """Put each payload (as `read` returns them) into its position's blocks."""
        if self._pool_bytes is not None:
            shape = (self.block_shape[0], 2, *self._pool_bytes.shape[3:])  # [L, 2, bs, H, D * itemsize]
            for block_ids, payload in zip(positions, payloads, strict=True):
                data = np.frombuffer(payload, dtype=np.uint8).reshape(shape)
                if not self.layout.is_grouped:
                    self._pool_bytes[:, :, block_ids[0]] = data
                    continue
                for layers, block_id in zip(self._layers, block_ids, strict=True):
                    self._pool_bytes[:len(layers), :, block_id] = data[layers]
            return
        for block_ids, payload in zip(positions, payloads, strict=True):  # a writable host copy, then to the device
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.kv_cache.dtype)
            data = data.view(self.block_shape).to(self.kv_cache.device)
            for layers, block_id in zip(self._layers, block_ids, strict=True):
                self.kv_cache[:len(layers), :, block_id].copy_(data[layers])
