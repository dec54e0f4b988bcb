"""RMSNorm in the two conventions checkpoints use."""

from __future__ import annotations

import torch
from torch import nn

from kvreuse.layers.pointwise import rms_norm


class RMSNorm(nn.Module):
    """Llama's: the weight in the model dtype, multiplied after the normalised x is rounded to that dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim]. Normalised in fp32 whatever the model dtype, as the reference implementation does."""
        return rms_norm(x, self.weight, self.eps, round_first=True)


class GemmaRMSNorm(nn.Module):
    """Gemma's: x normalised and scaled by `1 + w` in fp32, then rounded once. `weight` holds `1 + w` in fp32
    whatever the model dtype (the form a GGUF stores; an HF checkpoint's `w` is shifted when loaded)."""

    keeps_fp32 = True  # from_weights leaves its weight in fp32

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim]."""
        return rms_norm(x, self.weight, self.eps, round_first=False)
