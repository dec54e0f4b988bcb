"""Builds one forward's tensors from scheduled sequences, runs the model over the paged KV pool, samples."""

from __future__ import annotations

import torch

from kvreuse.config import SuffixConfig
from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache import blend
from kvreuse.layers.attention import AttentionMetadata, metadata_for_positions
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
        samples: list[bool] = []  # per sequence: its step reaches its last token, so it samples one
        for seq in seqs:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            samples.append(end == seq.num_tokens)
            if samples[-1]:
                logits_rows.append(len(input_ids) - 1)
        sampling = [seq for seq, s in zip(seqs, samples, strict=True) if s]
        meta = AttentionMetadata.build(
            [s.num_computed_tokens for s in seqs], [s.num_scheduled_tokens for s in seqs],
            [s.block_table for s in seqs], self.block_size, self.device,
        )
        logits = self.model(
            torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
            meta, self.kv_cache, torch.tensor(logits_rows, dtype=torch.long, device=self.device),
        )
        for row, seq in enumerate(sampling):
            if seq.params.keep_first_logits and seq.first_logits is None:
                seq.first_logits = logits[row].cpu()
        tokens = iter(sample(logits, [s.params for s in sampling], [s.generator for s in sampling]))
        return [next(tokens) if s else None for s in samples]

    # --- segment reuse -------------------------------------------------------------------------------
    def copy_segments(self, seq: Sequence) -> None:
        """Copy each reused run's K/V (every layer) into the sequence's own slots, re-rotating K by the
        distance it moved. The sources stay untouched (copy-on-write: the repair rewrites the copies)."""
        bs = self.block_size
        kv = self.kv_cache.view(self.kv_cache.shape[0], 2, -1, *self.kv_cache.shape[-2:])  # [L, 2, slots, Hkv, D]
        src_slots, src_pos, dst_pos = [], [], []
        for run in seq.segment_plan.runs:
            for i, block in enumerate(run.blocks):
                src_slots.extend(range(block.block_id * bs, block.block_id * bs + bs))
                src_pos.extend(range(block.position, block.position + bs))
                dst_pos.extend(range(run.start + i * bs, run.start + (i + 1) * bs))
        src = torch.tensor(src_slots, device=self.device)
        dst = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in dst_pos], device=self.device)
        deltas = torch.tensor(dst_pos, device=self.device) - torch.tensor(src_pos, device=self.device)
        kv[:, 0, dst] = self.model.rotary.rotate_by(kv[:, 0, src], deltas)
        kv[:, 1, dst] = kv[:, 1, src]

    @torch.inference_mode()
    def run_segments(self, seq: Sequence, suffix: SuffixConfig) -> int:
        """Prefill `seq` (all its uncomputed tokens, in one forward) reusing its segment plan, repaired
        per `suffix.mode`; then the fidelity guard. Returns the sampled token."""
        plan, start, end = seq.segment_plan, seq.num_computed_tokens, seq.num_tokens
        self.copy_segments(seq)
        num_rows = end - start
        reused = blend.reused_rows(plan, start, num_rows)                                      # [R] bool
        positions = torch.arange(start, end)
        input_ids = torch.tensor(seq.token_ids[start:end], device=self.device)
        meta_all = AttentionMetadata.build([start], [num_rows], [seq.block_table], self.block_size, self.device)
        meta_for = lambda rows: metadata_for_positions(positions[rows.cpu()].tolist(), seq.block_table,
                                                       self.block_size, self.device)
        if suffix.mode == "shift":
            # llama.cpp's --cache-reuse: the reused K/V are taken as they are; only the rest is computed.
            rows = (~reused).nonzero().flatten()
            meta = meta_for(rows)
            logits = self.model(input_ids[rows], positions[rows].to(self.device), meta, self.kv_cache,
                                torch.tensor([len(rows) - 1], device=self.device))[0]
            num_recomputed = 0
        else:
            heads = blend.head_rows(plan, start, num_rows, suffix.head_tokens)
            kept: list[torch.Tensor] = []
            k_layer1 = self.kv_cache[1, 0].view(-1, *self.kv_cache.shape[-2:])                # [slots, Hkv, D]

            def select(fresh_k: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
                deviation = blend.k_deviation(fresh_k, k_layer1[slot_mapping]).cpu()
                kept.append(blend.select_rows(reused, heads, deviation, suffix.recompute_ratio))
                return kept[0].to(self.device)

            logits = self.model.forward_selective(input_ids, positions.to(self.device), meta_all, self.kv_cache,
                                                  select_layer=1, select=select, meta_for=meta_for)
            num_recomputed = int(reused[kept[0]].sum())
        num_discarded = 0
        if num_recomputed < plan.num_tokens and near_tie(logits, suffix.guard_margin):
            # The approximate answer is a near-tie that reuse error can flip: compute exactly instead.
            logits = self.model(input_ids, positions.to(self.device), meta_all, self.kv_cache,
                                torch.tensor([num_rows - 1], device=self.device))[0]
            num_discarded = num_rows - int(reused.sum()) + num_recomputed  # the approximate pass's rows
            num_recomputed, seq.guarded = plan.num_tokens, True
        if seq.num_preemptions == 0:
            seq.num_recomputed_tokens, seq.num_discarded_tokens = num_recomputed, num_discarded
        if num_recomputed == plan.num_tokens:
            seq.num_exact_tokens = 1 << 62  # every reused token was recomputed: the whole KV is exact
        if seq.params.keep_first_logits and seq.first_logits is None:
            seq.first_logits = logits.cpu()
        return sample(logits[None], [seq.params], [seq.generator])[0]


def near_tie(logits: torch.Tensor, margin: float) -> bool:
    """The top-2 probability gap of logits [vocab] is below `margin`."""
    if margin <= 0:
        return False
    top2 = torch.softmax(logits.float(), dim=-1).topk(2).values
    return bool(top2[0] - top2[1] < margin)
