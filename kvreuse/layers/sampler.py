"""Turn last-position logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from kvreuse.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits: [S, vocab] fp32. Greedy rows take the argmax; the others sample from their filtered
    distribution with their own generator, so a seeded request is reproducible in any batch."""
    if len(params) != len(generators) or len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows, {len(params)} params, {len(generators)} generators")
    token_ids = logits.argmax(dim=-1).tolist()
    if all(p.greedy for p in params):
        return token_ids                                                  # the usual case: no per-row work
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        probs = filtered_probs(logits[row].cpu(), p)
        token_ids[row] = int(torch.multinomial(probs, 1, generator=generator))
    return token_ids


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits: [vocab] -> probabilities [vocab] after temperature, top-k and top-p."""
    logits = logits / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        outside = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs
