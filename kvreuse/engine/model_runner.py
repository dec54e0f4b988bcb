"""Builds one forward's tensors from scheduled sequences, runs the model over the paged KV pool, samples.

Sequences that reuse cached segments ride in the same forward as the rest of the batch; repair.py repairs their
reused K/V and says what it recomputed."""

from __future__ import annotations

import torch

from kvreuse.config import SuffixConfig
from kvreuse.engine.repair import RepairOutcome, forward_reusing
from kvreuse.engine.sequence import Sequence
from kvreuse.layers.attention import AttentionMetadata
from kvreuse.layers.sampler import sample
from kvreuse.model.llama import Llama
from kvreuse.model.loader import ModelArgs


def kv_bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block."""
    return args.num_layers * 2 * block_size * args.num_kv_heads * args.head_dim * dtype.itemsize


class ModelRunner:
    def __init__(self, model: Llama, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        args = model.args
        self.model, self.block_size, self.device = model, block_size, device
        # [num_layers, K/V, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(args.num_layers, 2, num_blocks, block_size, args.num_kv_heads, args.head_dim,
                                    dtype=dtype, device=device)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], reuse: SuffixConfig) -> tuple[list[int | None], dict[str, RepairOutcome]]:
        """Compute each sequence's `num_scheduled_tokens` tokens from `num_computed_tokens` on. A sequence with a
        segment plan is scheduled whole and reuses the plan's K/V, repaired per `reuse` (see repair.py).
        Returns a sampled token for each sequence whose step reaches its last token (else None), and the repair
        outcome of each sequence that reused segments, by request id."""
        starts = [s.num_computed_tokens for s in seqs]
        lens = [s.num_scheduled_tokens for s in seqs]
        input_ids = torch.tensor([t for s, a, n in zip(seqs, starts, lens, strict=True) for t in s.token_ids[a:a + n]],
                                 device=self.device)                                   # [T]
        positions = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lens, strict=True)])  # [T]
        samples = [a + n == s.num_tokens for s, a, n in zip(seqs, starts, lens, strict=True)]
        logits_rows = (torch.tensor(lens).cumsum(0) - 1)[torch.tensor(samples)]        # [S] each sampler's last row
        meta = AttentionMetadata.build(starts, lens, [s.kv.block_table for s in seqs], self.block_size, self.device)
        outcomes: dict[str, RepairOutcome] = {}
        if any(s.kv.segment_plan is not None for s in seqs):
            logits, outcomes = forward_reusing(self.model, self.kv_cache, seqs, input_ids, positions, meta,
                                               logits_rows, reuse)
        else:
            logits = self.model(input_ids, positions.to(self.device), meta, self.kv_cache,
                                logits_rows.to(self.device))
        sampling = [seq for seq, s in zip(seqs, samples, strict=True) if s]
        for row, seq in enumerate(sampling):
            if seq.params.keep_first_logits and seq.first_logits is None:
                seq.first_logits = logits[row].cpu()
        tokens = iter(sample(logits, [s.params for s in sampling], [s.generator for s in sampling]))
        return [next(tokens) if s else None for s in samples], outcomes
