"""What changes the model's logits before sampling, per request: logit_bias, min_tokens, penalties, a grammar.

Applied in that order, in place (the grammars' masks batched, last), to the rows that ask for any of it (most rows
ask for nothing and cost nothing).
The penalties are OpenAI's presence/frequency (over the generated tokens) and vLLM's repetition penalty (over the
prompt and the generated tokens: positive logits divided by it, negative ones multiplied).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvreuse.layers.grammar_mask import TokenMask, apply_mask
from kvreuse.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of logits to sample from, with what its processors read."""
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    grammar: TokenMask | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)  # EOS and stop_token_ids (masked under min_tokens)

    @property
    def processes_logits(self) -> bool:
        return self.params.processes_logits or self.grammar is not None


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """logits: [S, vocab] fp32, changed in place for the rows that ask for it."""
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        if not row.params.processes_logits:
            continue
        p, out = row.params, logits[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=out.device)
            out.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=out.device, dtype=out.dtype))
        if len(row.output_token_ids) < p.min_tokens and row.stop_ids:
            out[torch.tensor(sorted(row.stop_ids), device=out.device)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*row.prompt_token_ids, *row.output_token_ids}), dtype=torch.long,
                                device=out.device)
            picked = out[seen]
            out[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and len(row.output_token_ids):
            counts = torch.bincount(torch.tensor(row.output_token_ids, device=out.device), minlength=vocab)[:vocab]
            out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if any(row.grammar is not None for row in rows):
        apply_mask(logits, [row.grammar for row in rows])
