"""A GGUF tensor's quantized blocks as the decode kernel reads them (kvreuse/kernels/gguf_linear.cpp).

Every supported format is mapped, block of 32 inputs by block, onto one form: W[n, k] = scale * code + min, with
integer codes of 4 bits (Q4_0, Q4_1, Q4_K) or 8 bits (Q5_0, Q8_0, and Q6_K's 6-bit codes) and an fp32 scale and min
per group of 32 inputs (16 for Q6_K). The mapping is exact: `dequantize()` gives bit for bit what gguf-py's
dequantization gives (tests/test_gguf_kernel.py), because each format's scale * code is exact in fp32 and the min
absorbs its offset (Q4_0's d * (q - 8) = d * q + (-8 d)).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

BLOCK = 32
PANEL_ROWS = 16  # output rows whose blocks the kernel reads from one record (kPanel in gguf_linear.cpp)
SUPPORTED = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q6_K)


@dataclass(frozen=True)
class QuantizedBlocks:
    """One weight [N, K] in blocks of 32 inputs: codes [N, K * bits / 8] uint8 (4-bit: per block, 16 bytes whose
    low nibbles are inputs 0..15 and high nibbles 16..31), scales and mins [N, K / group] fp32."""
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bits: int
    source: str  # the GGUF type(s) it came from, e.g. "Q4_1"
    group: int = BLOCK  # inputs per scale and min: 32, or 16 (Q6_K)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * self.group

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] fp32: scale * code + min, as the kernel computes it."""
        n, k = self.shape
        codes = self.codes.view(n, k // BLOCK, -1)                       # [N, B, 16 | 32]
        if self.bits == 4:
            codes = torch.cat([codes & 15, codes >> 4], dim=-1)          # [N, B, 32]
        codes = codes.reshape(n, k // self.group, self.group)            # [N, groups, group]
        # min + code * scale in one pass: the product is exact in fp32 (module docstring), so it rounds once anyway
        return torch.addcmul(self.mins[..., None], codes.float(), self.scales[..., None]).reshape(n, k)

    def rows(self, index: torch.Tensor) -> QuantizedBlocks:
        """These blocks with their output rows reordered (or selected) by `index` [N']."""
        return QuantizedBlocks(self.codes[index].contiguous(), self.scales[index].contiguous(),
                               self.mins[index].contiguous(), self.bits, self.source, self.group)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins))

    def pack(self) -> PackedBlocks:
        """The kernel's layout (gguf_linear.cpp): per panel of PANEL_ROWS output rows (the last one padded with zero
        rows), per block, one record of the panel's scales, its mins (each [32 / group, PANEL_ROWS]; fp16 where every
        one is an fp16 number, else fp32) and its codes as vectors across the panel's rows ([16 | 32, PANEL_ROWS])."""
        n, k = self.shape
        pad, num_blocks = -n % PANEL_ROWS, k // BLOCK
        scales, mins, codes = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (self.scales, self.mins, self.codes))
        half = all(torch.equal(t.half().float(), t) for t in (scales, mins))
        panels = (n + pad) // PANEL_ROWS

        def across_rows(t: torch.Tensor) -> torch.Tensor:  # [N', B * w] -> [panels, B, w * PANEL_ROWS] bytes
            t = t.view(panels, PANEL_ROWS, num_blocks, -1).permute(0, 2, 3, 1)    # [panels, B, w, PANEL_ROWS]
            return t.contiguous().view(torch.uint8).view(panels, num_blocks, -1)

        wide = torch.float16 if half else torch.float32
        parts = [across_rows(scales.to(wide)), across_rows(mins.to(wide)), across_rows(codes)]
        return PackedBlocks(torch.cat(parts, dim=-1).view(-1), n, self.bits, self.group, half)


@dataclass(frozen=True)
class PackedBlocks:
    """QuantizedBlocks in the kernel's layout: `data` uint8, the weight's `out_features`, code width, group, and
    whether the scales and mins are held as fp16."""
    data: torch.Tensor
    out_features: int
    bits: int
    group: int
    half_scales: bool


def concat(parts: list[QuantizedBlocks]) -> QuantizedBlocks | None:
    """Blocks stacked along the output rows (a fused qkv or gate_up), or None where their code widths or groups
    differ."""
    if len({(p.bits, p.group, p.shape[1]) for p in parts}) != 1:
        return None
    return QuantizedBlocks(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           torch.cat([p.mins for p in parts]), parts[0].bits,
                           "+".join(dict.fromkeys(p.source for p in parts)), parts[0].group)


def from_gguf(data: np.ndarray, qtype: QType) -> QuantizedBlocks | None:
    """The blocks of a GGUF tensor (`data`: the reader's [N, bytes per row] uint8, usually a read-only view of the
    mapped file), or None for a type the kernel does not read. Parsed with torch ops, in torch's threads: numpy's
    strided ops took ~10x longer on Gemma 3's 262k-row embedding."""
    if qtype not in SUPPORTED:
        return None
    n = data.shape[0]
    with warnings.catch_warnings():  # read-only: every op below makes new tensors, none writes into the file
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        raw = torch.from_numpy(data)
    if qtype in _SUPER_BLOCK:
        codes, scales, mins = _SUPER_BLOCK[qtype](raw.reshape(-1, _BLOCK_BYTES[qtype]))
    else:
        codes, scales, mins = _BLOCK_32[qtype](raw.reshape(n * data.shape[1] // _BLOCK_BYTES[qtype], -1))
    codes, scales, mins = codes.reshape(n, -1), scales.reshape(n, -1), mins.reshape(n, -1)
    bits = 4 if qtype in (QType.Q4_0, QType.Q4_1, QType.Q4_K) else 8
    packed = _pack4(codes) if bits == 4 else codes
    return QuantizedBlocks(packed.contiguous(), scales.contiguous(), mins.contiguous(), bits, qtype.name,
                           16 if qtype == QType.Q6_K else BLOCK)


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 -> [N, K / 2]: per block of 32, byte j holds input j (low nibble) and j + 16 (high)."""
    blocks = codes.reshape(codes.shape[0], -1, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def _half(column: torch.Tensor) -> torch.Tensor:
    """[B, 2] bytes -> [B] fp32: the little-endian fp16 they hold."""
    return column.contiguous().view(torch.float16).float()[:, 0]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[B, 16] bytes -> [B, 32] codes: low nibbles first, then high (ggml's 32-input blocks)."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def _q4_0(b: torch.Tensor):
    d = _half(b[:, :2])
    return _nibbles(b[:, 2:]), d, -8 * d


def _q4_1(b: torch.Tensor):
    return _nibbles(b[:, 4:]), _half(b[:, :2]), _half(b[:, 2:4])


def _q5_0(b: torch.Tensor):
    d = _half(b[:, :2])
    high = b[:, 2:6].contiguous().view(torch.int32) >> torch.arange(32, dtype=torch.int32)  # [B, 32]: bit j at 0
    codes = _nibbles(b[:, 6:]) | ((high & 1).to(torch.uint8) << 4)
    return codes, d, -16 * d


def _q8_0(b: torch.Tensor):
    d = _half(b[:, :2])
    return b[:, 2:] ^ 0x80, d, -128 * d  # int8 q + 128 as a byte: its sign bit flipped


def _q4_k(b: torch.Tensor):
    """Super-blocks of 256: fp16 d and dmin, 8 six-bit scales and mins, then 4 chunks of 32 bytes whose low nibbles
    are one 32-input block and high nibbles the next."""
    from gguf.quants import Q4_K

    d, dmin = _half(b[:, :2]), _half(b[:, 2:4])
    sc, m = (torch.from_numpy(np.asarray(t, dtype=np.float32)) for t in Q4_K.get_scale_min(b[:, 4:16].numpy()))
    qs = b[:, 16:].reshape(-1, 4, 32)                                    # [S, chunk, 32]
    codes = torch.stack([qs & 15, qs >> 4], dim=2).reshape(-1, 32)       # [S * 8, 32]
    scales = (d[:, None] * sc).reshape(-1)                               # [S, 8] -> [S * 8]
    mins = -(dmin[:, None] * m).reshape(-1)
    return codes, scales, mins


def _q6_k(b: torch.Tensor):
    """Super-blocks of 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 inputs),
    fp16 d. Each half of 128 inputs takes its low nibbles from 64 bytes (low, then high nibbles) and its top bits
    from 32 bytes (bits 0-1, 2-3, 4-5, 6-7: four runs of 32 inputs). code = q + 32, W = d * scale * (q - 32)."""
    low = b[:, :128].reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    low = (low & 15).reshape(-1, 2, 128)                                 # [S, half, 128]
    high = b[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = (high & 3).reshape(-1, 2, 128)
    codes = (low | (high << 4)).reshape(-1, 32)                          # [S * 8, 32] in 0..63
    scales = (_half(b[:, 208:210])[:, None] * b[:, 192:208].contiguous().view(torch.int8).float()).reshape(-1)
    return codes, scales, -32 * scales                                   # scales, mins: [S * 16]


_BLOCK_32 = {QType.Q4_0: _q4_0, QType.Q4_1: _q4_1, QType.Q5_0: _q5_0, QType.Q8_0: _q8_0}
_SUPER_BLOCK = {QType.Q4_K: _q4_k, QType.Q6_K: _q6_k}
_BLOCK_BYTES = {QType.Q4_0: 18, QType.Q4_1: 20, QType.Q5_0: 22, QType.Q8_0: 34, QType.Q4_K: 144, QType.Q6_K: 210}
