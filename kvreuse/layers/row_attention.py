"""Prompt attention on a CPU, one query row at a time: each row attends to exactly its visible keys (0 .. its position,
or the last `window` of them) in an order that depends on that row alone, never on how many rows its step holds or
which rows sit beside it. That makes prefix reuse exact (docs/design/batch-invariance.md): SDPA's CPU kernel
multiplies a block of a sequence's query rows by its keys in one GEMM whose summation order follows the block's row
count, so a cache hit's suffix rows rounded differently from the same rows in the cold prompt.

The C++ op (kernels/prefill_attention.cpp) computes each row as the fused decode kernel computes a decode row, so a
decode row riding along with a prompt chunk gets the bits it would get in a decode step. Without the extension
(`KVREUSE_CPU_KERNELS=0`, no compiler) `attend_rows_in_torch` computes the same attention, one row a step, each row's
ops shaped by that row alone: invariant too, but slow on long prompts.
"""

from __future__ import annotations

import torch

from kvreuse.kernels import build as kernels
from kvreuse.layers.kv_format import format_of

KERNEL_POOLS = {torch.float32: (torch.float32, torch.bfloat16), torch.bfloat16: (torch.bfloat16,)}


def kernels_read(q_dtype: torch.dtype, k_cache: torch.Tensor) -> bool:
    """Whether both attention kernels (this op and the fused decode) take queries of `q_dtype` over this pool: fp32
    queries over fp32 or bf16 rows, bf16 queries over bf16 rows, either over 8-bit rows."""
    return q_dtype in KERNEL_POOLS and (k_cache.dtype in KERNEL_POOLS[q_dtype] or format_of(k_cache).quantized)


def kernel_takes(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C++ op attends these rows: a CPU, a pool `kernels_read`, the extension loaded."""
    return q.device.type == "cpu" and kernels_read(q.dtype, k_cache) and kernels.load().loaded


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_slots: torch.Tensor,
                row_seq: torch.Tensor, row_pos: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """q [T, H, D] (rotated; the rows' K/V already stored); context_slots [B, K]: the pool slot of each sequence's key
    at each position; row_seq, row_pos [T]: each row's sequence and position (< K); window 0: no sliding window.
    Returns [T, H * D]."""
    if kernel_takes(q, k_cache):
        return torch.ops.kvreuse_cpu.prefill_attention(q.contiguous(), k_cache, v_cache, context_slots, row_seq,
                                                       row_pos, window, scale)
    return attend_rows_in_torch(q, k_cache, v_cache, context_slots, row_seq, row_pos, scale, window)


def attend_rows_in_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_slots: torch.Tensor,
                         row_seq: torch.Tensor, row_pos: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """`attend_rows` in torch ops: each row's keys gathered into a fresh tensor of that row's length, so every op a
    row takes has the row's shape alone. Softmax in fp32, as SDPA's CPU kernel computes it."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    groups = q.view(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)      # [T, Hkv, G, D]
    out = torch.empty_like(groups)                                                     # [T, Hkv, G, D]
    kv_format = format_of(k_cache)
    k_rows, v_rows = (cache.view(-1, *cache.shape[-2:]) for cache in (k_cache, v_cache))  # [slots, Hkv, W]
    for t, (b, position) in enumerate(zip(row_seq.tolist(), row_pos.tolist(), strict=True)):
        first = max(0, position - window + 1) if window else 0
        slots = context_slots[b, first:position + 1]                                   # [L]
        k = kv_format.decode(k_rows.index_select(0, slots), q.dtype)                   # [L, Hkv, D]
        v = kv_format.decode(v_rows.index_select(0, slots), q.dtype)                   # [L, Hkv, D]
        scores = torch.matmul(groups[t], k.permute(1, 2, 0)).float() * scale           # [Hkv, G, L]
        out[t] = torch.matmul(scores.softmax(-1).to(q.dtype), v.transpose(0, 1))       # [Hkv, G, D]
    return out.view(num_rows, num_heads * head_dim)
