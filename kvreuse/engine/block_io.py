"""The KV pool's blocks as bytes, for the tiers under it (kvcache/tiers/store.py's BlockIO).

Both directions copy block by block: a strided block of the pool to or from a contiguous buffer in one copy each
(a gather-then-permute costs two; measured 15 vs 27 ms to read, 6 vs 18 ms to write 128 bf16 blocks)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from kvreuse.kvcache.tiers.entry import BlockSpec

# Loaded entries are read-only bytes; they are only ever copied from, never written through the tensor view.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=__name__)


class PoolBlockIO:
    def __init__(self, kv_cache: torch.Tensor, fingerprint: str):
        self.kv_cache = kv_cache  # [num_layers, K/V, num_blocks, block_size, num_kv_heads, head_dim]
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        self.block_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        self.spec = BlockSpec(fingerprint, str(kv_cache.dtype).removeprefix("torch."), block_size, self.block_shape,
                              kv_cache.dtype.itemsize)

    def read(self, block_ids: Sequence[int]) -> list[np.ndarray]:
        """Each block's K/V as one contiguous host array of bytes."""
        out = torch.empty(len(block_ids), *self.block_shape, dtype=self.kv_cache.dtype)  # [n, L, 2, bs, H, D]
        for j, block_id in enumerate(block_ids):
            out[j].copy_(self.kv_cache[:, :, block_id])
        return list(out.view(torch.uint8).reshape(len(block_ids), -1).numpy())

    def write(self, block_ids: Sequence[int], payloads: Sequence) -> None:
        for block_id, payload in zip(block_ids, payloads, strict=True):
            data = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8)).view(self.kv_cache.dtype)
            self.kv_cache[:, :, block_id].copy_(data.view(self.block_shape))
