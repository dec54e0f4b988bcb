"""Turn last-position logits into next tokens: processors, greedy, temperature, top-k, top-p, per-request seeds, and
the log-probabilities asked for.

Log-probabilities are those of the distribution the token was drawn from: the logits after logit_bias, penalties and
the grammar, divided by the temperature (a greedy row's temperature counts as 1), before top-k/top-p truncation.
Prompt log-probabilities (`prompt_logprobs`) are the model's own (no processors, temperature 1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvreuse.layers.logits_processors import SamplingRow, process_logits
from kvreuse.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the most likely alternatives at its position, best first."""
    token_id: int
    logprob: float
    rank: int | None                           # 1 for the most likely token (None for prompt tokens: not computed)
    top: tuple[tuple[int, float], ...] = ()    # (token id, logprob) x the number asked for


def sample_rows(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [S, vocab] fp32 (processed in place). The token of each row, and its TokenLogprob where the row's
    params ask for logprobs or best_of (which ranks choices by their cumulative logprob), else None."""
    if len(rows) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows, {len(rows)} sampling rows")
    if any(r.processes_logits for r in rows):
        process_logits(logits, rows)
    token_ids = logits.argmax(dim=-1).tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    if all(r.params.greedy and not r.params.draws_logprobs for r in rows):
        return token_ids, logprobs                                       # the usual case: no per-row work
    for i, row in enumerate(rows):
        p = row.params
        if not p.greedy:
            probs = filtered_probs(logits[i].cpu(), p)
            token_ids[i] = int(torch.multinomial(probs, 1, generator=row.generator))
        if p.draws_logprobs:
            scaled = logits[i] if p.greedy else logits[i] / p.temperature
            logprobs[i] = token_logprob(torch.log_softmax(scaled, dim=-1), token_ids[i], p.logprobs or 0)
    return token_ids, logprobs


def token_logprob(logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """logprobs: [vocab] log-softmax; the TokenLogprob of `token_id` with its `num_top` best alternatives."""
    chosen = logprobs[token_id]
    rank = int((logprobs > chosen).sum()) + 1
    top = ()
    if num_top:
        values, ids = logprobs.topk(num_top)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id, float(chosen), rank, top)


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
