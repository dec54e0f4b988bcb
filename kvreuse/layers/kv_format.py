"""How K/V values sit in the pool (`cache.kv_dtype`): as the model computes them, or in 8 bits with a scale per row.

A row is one token's K or V of one KV head: head_dim values. An 8-bit row holds head_dim codes and then its fp32
scale, in the row's last 4 bytes (the same storage dtype, viewed as fp32). A block's bytes therefore carry their own
scales, so the tiers and the copy jobs move blocks as bytes whatever the format. The scale is the row's largest
magnitude over the code's largest (symmetric, absmax): one scale per token and head, which follows each token's size
as it is written and never needs a block to be complete (a scale per channel of K would; docs/features/kv-dtype.md
measures both).

The pool's storage dtype names its format (`format_of`): the attention kernels read it from the cache tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # an fp32 scale at the end of each 8-bit row


@dataclass(frozen=True)
class KVFormat:
    """One way to hold K/V rows. `encode` turns values [..., D] into storage rows [..., row_width(D)]; `decode` turns
    rows back into values of `dtype`. The plain formats store values as they are."""
    name: str                        # as `cache.kv_dtype` names it: fp32, bf16, int8, fp8
    storage: torch.dtype             # the pool tensor's dtype (fp8 codes sit in uint8, which every index op takes)
    code: torch.dtype | None = None  # an 8-bit format's codes
    max_code: float = 0.0            # the largest code magnitude

    @property
    def quantized(self) -> bool:
        return self.code is not None

    @property
    def value_dtype(self) -> torch.dtype:
        """The dtype its values are worked on in where no model dtype applies: its own, or fp32 for 8 bits."""
        return torch.float32 if self.quantized else self.storage

    def row_width(self, head_dim: int) -> int:
        """Storage elements (bytes, for an 8-bit format) of one row of `head_dim` values."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def bytes_per_row(self, head_dim: int) -> int:
        return self.row_width(head_dim) * self.storage.itemsize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] values -> [..., row_width(D)] storage rows."""
        if not self.quantized:
            return x.to(self.storage)
        x = x.float()
        scale = (x.abs().amax(dim=-1, keepdim=True) / self.max_code).clamp_min(torch.finfo(torch.float32).tiny)
        scaled = (x / scale).clamp_(-self.max_code, self.max_code)                     # [..., D]
        codes = scaled.round_() if self.code == torch.int8 else scaled  # fp8 rounds in its cast
        return torch.cat([codes.to(self.code).view(self.storage), scale.view(self.storage)], dim=-1)  # [..., D + 4]

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows: [..., row_width(D)] storage -> [..., D] values in `dtype`."""
        if not self.quantized:
            return rows.to(dtype)
        head_dim = rows.shape[-1] - SCALE_BYTES
        scale = rows[..., head_dim:].view(torch.float32)                               # [..., 1]
        return (rows[..., :head_dim].view(self.code).float() * scale).to(dtype)       # [..., D]


FORMATS = {
    "fp32": KVFormat("fp32", torch.float32),
    "bf16": KVFormat("bf16", torch.bfloat16),
    "int8": KVFormat("int8", torch.int8, torch.int8, 127.0),
    "fp8": KVFormat("fp8", torch.uint8, torch.float8_e4m3fn, 448.0),  # e4m3's largest finite value
}
_BY_STORAGE = {f.storage: f for f in FORMATS.values()}
MODEL_DTYPE_FORMAT = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def format_of(cache: torch.Tensor) -> KVFormat:
    """The format of a pool (or one layer's view of it), from its storage dtype."""
    return _BY_STORAGE[cache.dtype]


def resolve_kv_format(kv_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """`cache.kv_dtype` for a model computing in `model_dtype`: `auto` stores what the model computes."""
    return FORMATS[MODEL_DTYPE_FORMAT[model_dtype] if kv_dtype == "auto" else kv_dtype]
