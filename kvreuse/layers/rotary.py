"""Rotary position embedding (rotate-half layout), with a table indexed by absolute position, and the frequency
scalings of `Rope`, a model's rotary settings (linear, llama3, a GGUF's per-frequency factors)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_KINDS = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Rope:
    """One rotary embedding: its base and how its frequencies are scaled (`kind`, one of ROPE_KINDS)."""
    theta: float
    kind: str = "default"
    factor: float = 1.0                   # linear and llama3: positions (or low frequencies) slowed by this much
    low_freq_factor: float = 1.0          # llama3
    high_freq_factor: float = 4.0         # llama3
    original_max_position: int = 8192     # llama3: the context length the model was trained at
    freq_factors: tuple[float, ...] | None = None  # a GGUF's `rope_freqs`: frequency i divided by freq_factors[i]

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope type {self.kind!r} is not supported (supported: {', '.join(ROPE_KINDS)})")


def inv_frequencies(head_dim: int, rope: Rope) -> torch.Tensor:
    """The rotation speed of each of the head's D/2 pairs [D/2], float64, after `rope`'s scaling."""
    pairs = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (rope.theta ** (pairs / head_dim))  # [D/2]
    if rope.freq_factors is not None:
        if len(rope.freq_factors) != head_dim // 2:
            raise ValueError(f"{len(rope.freq_factors)} rope frequency factors for a head of {head_dim}")
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float64, device="cpu")
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.kind == "llama3":
        # Low frequencies (wavelength past the original context / low_freq_factor) slowed by `factor`, high ones
        # kept, and the band between interpolated smoothly.
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, (1 - smooth) * scaled / rope.factor + smooth * scaled, scaled)
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: Rope | float):
        super().__init__()
        rope = rope if isinstance(rope, Rope) else Rope(float(rope))
        # Angles in float64 so that rotating by p then by q - p matches rotating by q at large positions. Computed
        # on the CPU even inside a meta-device context (a model's skeleton): the table is not a checkpoint's, and
        # arange on meta imports dynamo (~1 s of a server's start).
        # The float64 angles are one [P, D/2] table; each half is rounded to fp32 before it is doubled, so no
        # float64 [P, D] copy is ever made.
        positions = torch.arange(max_position, dtype=torch.float64, device="cpu")
        angles = torch.outer(positions, inv_frequencies(head_dim, rope))  # [P, D/2]
        cos, sin = angles.cos().float(), angles.sin().float()               # [P, D/2]
        self.register_buffer("cos_table", torch.cat([cos, cos], dim=-1), persistent=False)  # [P, D]
        self.register_buffer("sin_table", torch.cat([sin, sin], dim=-1), persistent=False)  # [P, D]

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
