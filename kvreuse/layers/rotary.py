"""Rotary position embedding (rotate-half layout), with a table indexed by absolute position."""

from __future__ import annotations

import torch


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        # Angles in float64 so that rotating by p then by q - p matches rotating by q at large positions.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # [D/2]
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)  # [P, D/2]
        angles = torch.cat([angles, angles], dim=-1)  # [P, D]
        self.register_buffer("cos_table", angles.cos().float(), persistent=False)
        self.register_buffer("sin_table", angles.sin().float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, D] for integer positions [T]; computed once per forward, used by every layer."""
        return self.cos_table[positions].unsqueeze(1).to(dtype), self.sin_table[positions].unsqueeze(1).to(dtype)

    def rotate_by(self, k: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Move already-rotated keys k [..., T, Hkv, D] by `deltas` [T] positions (negative allowed):
        R(p + d) = R(d) R(p), so a cached key is re-positioned without knowing its pre-RoPE value."""
        magnitude = deltas.abs()
        cos = self.cos_table[magnitude].unsqueeze(1).to(k.dtype)                      # [T, 1, D]
        sin = self.sin_table[magnitude].unsqueeze(1).to(k.dtype) * deltas.sign().unsqueeze(-1).unsqueeze(-1)
        return apply_rotary(k, cos, sin)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, 1, D]. Rotating by angle a then b equals rotating by a + b,
    which is what lets a cached K be moved to another position (see kvcache segment reuse)."""
    return x * cos + rotate_half(x) * sin
