"""A layer's row-wise steps besides attention and the linears: RMSNorm, RoPE, the gated activations and a scale. On
a CPU with kvreuse's extension each is one op of it (kernels/pointwise.cpp), elsewhere (CUDA, `KVREUSE_CPU_KERNELS=0`)
the torch ops below, the reference the kernels are tested against.

A decode step runs eagerly while its compiled graph is built (a first start) and compiled after. The torch ops
inside a graph are inductor's to fuse: in bf16 it kept a fused chain's intermediates in fp32 and took its own exp and
sums, and a request answered otherwise once the graph was in. The kernels are opaque to inductor, so the graph calls
the very code the eager step calls, and a row gets the same bits either way (docs/design/batch-invariance.md). Each
row is computed from its own values alone, so a row's bits do not depend on the rows beside it either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvreuse.kernels import build as kernels
from kvreuse.layers.rotary import apply_rotary

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # the kernel's codes


def kernel_takes(x: torch.Tensor) -> bool:
    """Whether the extension computes this step of x: a CPU tensor in fp32 or bf16, the extension loaded."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and kernels.load().loaded


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool) -> torch.Tensor:
    """x [..., D] normalised in fp32 and scaled by weight [D]. `round_first`: the normalised x is rounded to x's dtype
    before the weight (in x's dtype) scales it, Llama's convention; otherwise (an fp32 weight, Gemma's `1 + w`) the
    product is rounded once."""
    if kernel_takes(x) and x.dim() in (2, 3):
        return torch.ops.kvreuse_cpu.rms_norm(x, weight, eps, round_first)
    return rms_norm_in_torch(x, weight, eps, round_first)


def rms_norm_in_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool) -> torch.Tensor:
    """`rms_norm` in torch ops."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    if round_first:
        return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)
    return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the angles of cos, sin [T, 1, D] (rotate-half layout, x's dtype) -> [T, H, D]."""
    if kernel_takes(x):
        return torch.ops.kvreuse_cpu.rotary(x, cos, sin)
    return apply_rotary(x, cos, sin)


def gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate_up [T, 2I] (the gate's I values, then the up projection's) -> act(gate) * up [T, I], act(gate) rounded to
    the dtype first; `activation` one of ACTIVATIONS."""
    if kernel_takes(gate_up) and gate_up.is_contiguous():
        return torch.ops.kvreuse_cpu.gated(gate_up, ACTIVATIONS[activation])
    return gated_in_torch(gate_up, activation)


def gated_in_torch(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """`gated` in torch ops."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x [T, D] times `scale` (a value of x's dtype), rounded once. As an op, a compiled graph cannot recompute it
    unrounded inside its consumers (inductor did, for Gemma's scaled embedding in the first residual add)."""
    if kernel_takes(x) and x.dim() == 2 and x.is_contiguous():
        return torch.ops.kvreuse_cpu.scaled(x, scale)
    return x * scale
