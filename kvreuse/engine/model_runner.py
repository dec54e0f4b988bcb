"""Builds one forward's tensors from scheduled sequences, runs the model over the paged KV pool, samples.

Sequences that reuse cached segments ride in the same forward as the rest of the batch; their reused K/V are
repaired per `cache.suffix.mode` (shift: taken as they are; blend: the rows blend.py selects are recomputed)."""

from __future__ import annotations

import torch

from kvreuse.config import SuffixConfig
from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache import blend
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
    def run(self, seqs: list[Sequence], suffix: SuffixConfig) -> list[int | None]:
        """Compute each sequence's `num_scheduled_tokens` tokens from `num_computed_tokens` on. A sequence with a
        segment plan is scheduled whole and reuses the plan's K/V, repaired per `suffix` (see `_forward_reusing`).
        Returns a sampled token for each sequence whose step reaches its last token, else None."""
        starts = [s.num_computed_tokens for s in seqs]
        lens = [s.num_scheduled_tokens for s in seqs]
        input_ids = torch.tensor([t for s, a, n in zip(seqs, starts, lens, strict=True) for t in s.token_ids[a:a + n]],
                                 device=self.device)                                   # [T]
        positions = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lens, strict=True)])  # [T]
        samples = [a + n == s.num_tokens for s, a, n in zip(seqs, starts, lens, strict=True)]
        logits_rows = (torch.tensor(lens).cumsum(0) - 1)[torch.tensor(samples)]        # [S] each sampler's last row
        meta = AttentionMetadata.build(starts, lens, [s.block_table for s in seqs], self.block_size, self.device)
        if any(s.segment_plan is not None for s in seqs):
            logits = self._forward_reusing(seqs, input_ids, positions, meta, logits_rows, suffix)
        else:
            logits = self.model(input_ids, positions.to(self.device), meta, self.kv_cache,
                                logits_rows.to(self.device))
        sampling = [seq for seq, s in zip(seqs, samples, strict=True) if s]
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

    def _forward_reusing(self, seqs: list[Sequence], input_ids: torch.Tensor, positions: torch.Tensor,
                         meta: AttentionMetadata, logits_rows: torch.Tensor, suffix: SuffixConfig) -> torch.Tensor:
        """The forward of a batch in which some sequences reuse cached segments (each scheduled whole, so each
        samples), repaired per `suffix.mode`, then the fidelity guard per reusing sequence. Sequences without a
        plan (other prefills, decodes) are computed in full. Returns fp32 logits [S, vocab] of `logits_rows`."""
        lens = [s.num_scheduled_tokens for s in seqs]
        bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]                             # seq b owns rows [b_i, b_i+1)
        reused = torch.zeros(bounds[-1], dtype=torch.bool)                                # [T]
        heads = torch.zeros(bounds[-1], dtype=torch.bool)                                 # [T]
        for seq, a, b in zip(seqs, bounds, bounds[1:], strict=False):
            if seq.segment_plan is not None:
                self.copy_segments(seq)
                reused[a:b] = blend.reused_rows(seq.segment_plan, seq.num_computed_tokens, b - a)
                heads[a:b] = blend.head_rows(seq.segment_plan, seq.num_computed_tokens, b - a, suffix.head_tokens)
        row_seq = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lens))   # [T] each row's sequence
        tables = [s.block_table for s in seqs]
        meta_for = lambda rows: AttentionMetadata.for_queries(
            [positions[rows][row_seq[rows] == i] for i in range(len(seqs))], tables, self.block_size, self.device)
        if suffix.mode == "shift":
            # llama.cpp's --cache-reuse: the reused K/V are taken as they are; only the rest is computed.
            kept = (~reused).nonzero().flatten()
            logits = self.model(input_ids[kept.to(self.device)], positions[kept].to(self.device), meta_for(kept),
                                self.kv_cache, torch.searchsorted(kept, logits_rows).to(self.device))
        else:
            k_layer1, v_layer1 = self.kv_cache[1].view(2, -1, *self.kv_cache.shape[-2:])  # [slots, Hkv, D] each
            selected: list[torch.Tensor] = []

            def select(fresh_k: torch.Tensor, fresh_v: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
                deviation = blend.kv_deviation(fresh_k, k_layer1[slot_mapping],
                                               fresh_v, v_layer1[slot_mapping]).cpu()    # [T]
                selected.append(torch.cat([a + blend.select_rows(reused[a:b], heads[a:b], deviation[a:b],
                                                                 suffix.recompute_ratio)
                                           for a, b in zip(bounds, bounds[1:], strict=False)]))
                return selected[0].to(self.device)

            logits = self.model.forward_selective(input_ids, positions.to(self.device), meta, self.kv_cache,
                                                  logits_rows.to(self.device), select_layer=1, select=select,
                                                  meta_for=meta_for)
            kept = selected[0]
        recomputed = torch.zeros_like(reused)
        recomputed[kept] = True
        recomputed &= reused                                                              # [T] reused rows redone
        logits_row_of = {row: i for i, row in enumerate(logits_rows.tolist())}
        for seq, a, b in zip(seqs, bounds, bounds[1:], strict=False):
            plan = seq.segment_plan
            if plan is None:
                continue
            num_recomputed, num_discarded = int(recomputed[a:b].sum()), 0
            i = logits_row_of[b - 1]
            if num_recomputed < plan.num_tokens and near_tie(logits[i], suffix.guard_margin):
                # The approximate answer is a near-tie that reuse error can flip: compute exactly instead.
                exact_meta = AttentionMetadata.build([seq.num_computed_tokens], [b - a], [seq.block_table],
                                                     self.block_size, self.device)
                logits[i] = self.model(input_ids[a:b], positions[a:b].to(self.device), exact_meta, self.kv_cache,
                                       torch.tensor([b - a - 1], device=self.device))[0]
                num_discarded = b - a - int(reused[a:b].sum()) + num_recomputed  # the approximate pass's rows
                num_recomputed, seq.guarded = plan.num_tokens, True
            if seq.num_preemptions == 0:
                seq.num_recomputed_tokens, seq.num_discarded_tokens = num_recomputed, num_discarded
            if num_recomputed == plan.num_tokens:
                seq.num_exact_tokens = 1 << 62  # every reused token was recomputed: the whole KV is exact
        return logits


def near_tie(logits: torch.Tensor, margin: float) -> bool:
    """The top two log-probabilities of logits [vocab] are less than `margin` nats apart. (A gap in logits, not
    in probabilities: reuse error shifts logits, and a flat distribution can still have a clear winner.)"""
    if margin <= 0:
        return False
    top2 = logits.float().topk(2).values
    return bool(top2[0] - top2[1] < margin)
