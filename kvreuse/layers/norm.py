"""RMSNorm in the two conventions checkpoints use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama's: the weight in the model dtype, multiplied after the normalised x is rounded to that dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim]. Normalised in fp32 whatever the model dtype, as the reference implementation does."""
        if x.dtype == torch.float32:
            # One call instead of seven Python-level ops (torch still runs them as kernels inside), and the
            # same numbers (tests/test_decode_fastpath.py).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Lower precision: the reference rounds the normalised x to the model dtype before scaling by the weight.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


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
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)
