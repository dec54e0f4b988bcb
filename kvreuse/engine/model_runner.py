"""Builds one forward's tensors from scheduled sequences, runs the model over the paged KV pool, samples."""

from __future__ import annotations

import torch

from kvreuse.engine.sequence import Sequence
from kvreuse.layers.attention import AttentionMetadata
from kvreuse.layers.sampler import sample
from kvreuse.model.llama import Llama


class ModelRunner:
    def __init__(self, model: Llama, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        args = model.args
        self.model, self.block_size, self.device = model, block_size, device
        # [num_layers, K/V, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(args.num_layers, 2, num_blocks, block_size, args.num_kv_heads, args.head_dim,
                                    dtype=dtype, device=device)

    @property
    def bytes_per_block(self) -> int:
        return self.kv_cache[:, :, 0].numel() * self.kv_cache.element_size()

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> list[int | None]:
        """Compute each sequence's `num_scheduled_tokens` tokens from `num_computed_tokens` on.
        Returns a sampled token for each sequence whose step reaches its last token, else None."""
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            if end == seq.num_tokens:
                logits_rows.append(len(input_ids) - 1)
        meta = AttentionMetadata.build(
            [s.num_computed_tokens for s in seqs], [s.num_scheduled_tokens for s in seqs],
            [s.block_table for s in seqs], self.block_size, self.device,
        )
        logits = self.model(
            torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
            meta, self.kv_cache, torch.tensor(logits_rows, dtype=torch.long, device=self.device),
        )
        sampling = [s for s in seqs if s.num_computed_tokens + s.num_scheduled_tokens == s.num_tokens]
        sampled = iter(sample(logits, [s.params for s in sampling], [s.generator for s in sampling]))
        return [next(sampled) if s.num_computed_tokens + s.num_scheduled_tokens == s.num_tokens else None
                for s in seqs]
