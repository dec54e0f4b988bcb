"""How K/V values sit in the pool (`cache.kv_dtype`): as the model computes them, or in 8 bits with a scale per group.

A row is one token's K or V of one KV head: head_dim values. An 8-bit row holds head_dim codes and then one fp16
scale per group of GROUP values (llama.cpp's q8_0 groups), in the row's last bytes (the same storage dtype, viewed
as fp16). A block's bytes therefore carry their own scales, so the tiers and the copy jobs move blocks as bytes
whatever the format. A scale is its group's largest magnitude over the code's largest (symmetric, absmax), fixed when
the token is written: a token's codes never depend on which tokens were written with it, which keeps prefix reuse
exact within a mode. Groups, not one scale per row: Gemma 3's keys spread 6x between channels, and one scale per row
lost 5 of its 6 greedy continuations (docs/features/kv-dtype.md). A scale per channel of K (KIVI's) would need a
block's tokens before any could be encoded, so a block written in one prefill and one written token by token would
differ.

int8 holds each row in a Hadamard basis (QuaRot's rotation): `to_basis` spreads a few large channels over all of a
row's values before they share scales, and attention, which only takes inner products of q with K and sums of V, runs
in that basis unchanged (q and the output change basis with it). The change is its own inverse. fp8 keeps the plain
basis: its codes' error follows each value's size, and spreading it measured worse (docs/features/kv-dtype.md).

The pool's storage dtype names its format (`format_of`): the attention kernels read it from the cache tensor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvreuse.kernels import build as kernels

GROUP = 32                   # values that share a scale (fewer where head_dim is not a multiple of it)
SCALE_DTYPE = torch.float16  # 2 bytes a scale: 2 + 32 bytes per 32 values, 0.266x fp32


@dataclass(frozen=True)
class KVFormat:
    """One way to hold K/V rows. `encode` turns values [..., D] into storage rows [..., row_width(D)]; `decode` turns
    rows back into values of `dtype`. The plain formats store values as they are."""
    name: str                        # as `cache.kv_dtype` names it: fp32, bf16, int8, fp8
    storage: torch.dtype             # the pool tensor's dtype (fp8 codes sit in uint8, which every index op takes)
    code: torch.dtype | None = None  # an 8-bit format's codes
    max_code: float = 0.0            # the largest code magnitude
    rotated: bool = False            # rows hold K/V in a Hadamard basis (`to_basis`): int8's

    @property
    def quantized(self) -> bool:
        return self.code is not None

    @property
    def value_dtype(self) -> torch.dtype:
        """The dtype its values are worked on in where no model dtype applies: its own, or fp32 for 8 bits."""
        return torch.float32 if self.quantized else self.storage

    def row_width(self, head_dim: int) -> int:
        """Storage elements (bytes, for an 8-bit format) of one row of `head_dim` values."""
        if not self.quantized:
            return head_dim
        return head_dim + head_dim // group_size(head_dim) * SCALE_DTYPE.itemsize

    def bytes_per_row(self, head_dim: int) -> int:
        return self.row_width(head_dim) * self.storage.itemsize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] values -> [..., row_width(D)] storage rows."""
        if not self.quantized:
            return x.to(self.storage)
        head_dim = x.shape[-1]
        groups = x.float().unflatten(-1, (-1, group_size(head_dim)))                   # [..., D / g, g]
        scale = (groups.abs().amax(dim=-1, keepdim=True) / self.max_code).clamp_(SMALLEST_SCALE, LARGEST_SCALE)
        scale = scale.to(SCALE_DTYPE)                                                  # [..., D / g, 1]
        scaled = (groups / scale.float()).clamp_(-self.max_code, self.max_code).flatten(-2)  # [..., D]
        codes = scaled.round_() if self.code == torch.int8 else scaled  # fp8 rounds in its cast
        return torch.cat([codes.to(self.code).view(self.storage), scale.flatten(-2).view(self.storage)], dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows: [..., row_width(D)] storage -> [..., D] values in `dtype`."""
        if not self.quantized:
            return rows.to(dtype)
        head_dim = self.head_dim_of(rows.shape[-1])
        scale = rows[..., head_dim:].view(SCALE_DTYPE).float()                         # [..., D / g]
        codes = rows[..., :head_dim].view(self.code).float().unflatten(-1, (scale.shape[-1], -1))  # [..., D / g, g]
        return (codes * scale[..., None]).flatten(-2).to(dtype)                        # [..., D]

    def to_basis(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] values -> the same vectors in the basis this format's rows hold them in. Its own inverse: it
        also brings vectors of that basis (decoded rows, attention's output) back."""
        return rotate(x) if self.rotated else x

    @property
    def fingerprint_tag(self) -> str:
        """What a cache key says of the rows' bytes: the name, and the basis they are in."""
        return f"{self.name}-hadamard" if self.rotated else self.name

    def head_dim_of(self, row_width: int) -> int:
        """The head_dim whose rows are `row_width` wide."""
        return _head_dim_of(row_width) if self.quantized else row_width


SMALLEST_SCALE = torch.finfo(SCALE_DTYPE).tiny  # an all-zero group keeps codes 0, never 0 / 0
LARGEST_SCALE = torch.finfo(SCALE_DTYPE).max


def group_size(head_dim: int) -> int:
    """Values per scale: GROUP, or the largest power of two below it that divides head_dim."""
    size = GROUP
    while head_dim % size:
        size //= 2
    return size


@functools.cache
def _head_dim_of(row_width: int) -> int:
    """The head_dim of an 8-bit row `row_width` bytes wide: D codes and D / g scales of 2 bytes."""
    for size in (GROUP >> i for i in range(GROUP.bit_length())):
        head_dim, rest = divmod(row_width * size, size + SCALE_DTYPE.itemsize)
        if not rest and group_size(head_dim) == size:
            return head_dim
    raise ValueError(f"no head_dim has 8-bit rows of {row_width} bytes")


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x: [..., D] -> [..., D], each run of `hadamard_size(D)` values times the normalized Hadamard matrix of that size
    (symmetric and orthogonal: rotating twice gives x back, up to rounding), by the fast Walsh-Hadamard transform in
    fp32. A row's bits depend on that row alone, never on how many rows share the call (a GEMM's do: MKL sums a
    256-wide row otherwise when fewer than 4 rows share it), as exact prefix reuse needs
    (docs/design/batch-invariance.md). On a CPU, kvreuse's kernel (kernels/hadamard.cpp), or without it the same
    butterflies in torch ops, bit for bit; on CUDA, where no path is row-invariant yet, one GEMM by the matrix."""
    if x.device.type != "cpu":
        size = hadamard_size(x.shape[-1])
        return (x.unflatten(-1, (-1, size)) @ hadamard_matrix(size, x.dtype, x.device)).flatten(-2)
    if x.dtype in (torch.float32, torch.bfloat16) and kernels.load().loaded:
        return torch.ops.kvreuse_cpu.hadamard(x.contiguous())
    return rotate_in_torch(x)


def rotate_in_torch(x: torch.Tensor) -> torch.Tensor:
    """`rotate` in torch ops: log2(P) rounds of butterflies (a + b, a - b) over blocks of 2 * half values, in fp32,
    then one multiply by 1 / sqrt(P)."""
    size = hadamard_size(x.shape[-1])
    runs = x.float().reshape(-1, size)                                                 # [N, P]
    half = 1
    while half < size:
        pairs = runs.view(-1, size // (2 * half), 2, half)                              # [N, blocks, 2, half]
        first, second = pairs[:, :, 0], pairs[:, :, 1]
        runs = torch.stack((first + second, first - second), dim=2).view(-1, size)      # [N, P]
        half *= 2
    return (runs * (1.0 / math.sqrt(size))).to(x.dtype).view(x.shape)


@functools.cache
def hadamard_matrix(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The normalized Hadamard matrix of a power-of-two `size`, [size, size]: the rotation of the identity's rows."""
    return rotate_in_torch(torch.eye(size)).to(dtype=dtype, device=device)


def hadamard_size(head_dim: int) -> int:
    """The rotation's block: the largest power of two that divides head_dim (head_dim itself for 64, 128, 256)."""
    return head_dim & -head_dim


FORMATS = {
    "fp32": KVFormat("fp32", torch.float32),
    "bf16": KVFormat("bf16", torch.bfloat16),
    "int8": KVFormat("int8", torch.int8, torch.int8, 127.0, rotated=True),
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
