"""Segment reuse, repaired: the whole policy in one place; the model only provides the mechanism
(`CausalLM.forward_selective`).

Beyond layer 0 a reused block's K/V depend on the text it was computed after, so reusing it in another context is
an approximation (docs/design/reuse.md). For each forward in which some sequences reuse cached segments:
1. copy: each plan's K/V (every layer) are copied into the sequence's own blocks, K re-rotated by the distance
   the segment moved (RoPE is a rotation); the cached sources stay untouched;
2. repair, per `settings.mode` (the `cache.suffix.*` keys, an immutable value):
   - shift (llama.cpp's --cache-reuse): reused K/V are taken as they are; only the other rows are computed;
   - blend (CacheBlend, EPIC): layers 0 and 1 run every row; then only the rows most likely to be wrong are
     recomputed at the deeper layers: the first `head_tokens` of each reused run (a chunk start carries a false
     attention sink), the top `recompute_ratio` of the other reused rows by how far their fresh layer-1 K and V
     are from the reused ones (KV deviation), and every row that was not reused. Ratio 1.0 is exact;
3. guard: where the result is a near-tie (top two log-probabilities closer than `guard_margin` nats), reuse error
   could flip the answer, so the sequence is computed exactly and the approximate pass counts as discarded work.
Each reusing sequence gets a RepairOutcome: what was recomputed, discarded and guarded, and whether its K/V are
now exact everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvreuse.config import SegmentConfig
from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.request import CacheRequest
from kvreuse.kvcache.segment import SegmentPlan
from kvreuse.layers.attention import AttentionMetadata, read_kv
from kvreuse.layers.kv_format import format_of
from kvreuse.model.decoder import CausalLM, ForwardKV

SELECT_LAYER = 1  # rows are ranked by their deviation here: the first layer whose K/V depend on context


@dataclass(frozen=True)
class RepairOutcome:
    num_recomputed_tokens: int        # reused tokens computed again (never counted as hits)
    num_discarded_tokens: int = 0     # token work of the approximate pass the guard threw away
    guarded: bool = False
    exact: bool = False               # every reused token was recomputed: the sequence's K/V are exact

    def account(self, record: ReuseRecord) -> ReuseRecord:
        """`record` (what admission planned) with what the repair did."""
        return replace(record, recomputed_tokens=self.num_recomputed_tokens, discarded_tokens=self.num_discarded_tokens,
                       guarded_requests=int(self.guarded))


# --- row selection ---------------------------------------------------------------------------------------
def reused_rows(plan: SegmentPlan, region_start: int, num_rows: int) -> torch.Tensor:
    """Boolean [num_rows]: which rows of the region [region_start, region_start + num_rows) were reused."""
    mask = torch.zeros(num_rows, dtype=torch.bool)
    for run in plan.runs:
        mask[run.start - region_start: run.start - region_start + run.num_tokens] = True
    return mask


def head_rows(plan: SegmentPlan, region_start: int, num_rows: int, head_tokens: int) -> torch.Tensor:
    """Boolean [num_rows]: the first `head_tokens` rows of each reused run."""
    mask = torch.zeros(num_rows, dtype=torch.bool)
    for run in plan.runs:
        first = run.start - region_start
        mask[first: first + min(head_tokens, run.num_tokens)] = True
    return mask


def relative_deviation(fresh: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:
    """Relative L2 distance per token; fresh, reused: [T, Hkv, D] -> [T]."""
    diff = (fresh.float() - reused.float()).flatten(1).norm(dim=-1)
    return diff / reused.float().flatten(1).norm(dim=-1).clamp_min(1e-6)


def kv_deviation(fresh_k: torch.Tensor, reused_k: torch.Tensor, fresh_v: torch.Tensor,
                 reused_v: torch.Tensor) -> torch.Tensor:
    """How far each token's fresh K and V are from the reused ones (relative, summed); [T, Hkv, D] each -> [T]."""
    return relative_deviation(fresh_k, reused_k) + relative_deviation(fresh_v, reused_v)


def select_rows(reused: torch.Tensor, heads: torch.Tensor, deviation: torch.Tensor, ratio: float) -> torch.Tensor:
    """Rows to compute at the deeper layers (ascending indices): every non-reused row, the run heads, and
    the `ratio` most deviating of the other reused rows. reused, heads: bool [T]; deviation: [T]."""
    keep = ~reused | heads
    candidates = (reused & ~heads).nonzero().flatten()
    num_extra = math.ceil(ratio * len(candidates))
    if num_extra:
        top = deviation[candidates].topk(num_extra).indices
        keep[candidates[top]] = True
    return keep.nonzero().flatten()


def near_tie(logits: torch.Tensor, margin: float) -> bool:
    """The top two log-probabilities of logits [vocab] are less than `margin` nats apart. (A gap in logits, not
    in probabilities: reuse error shifts logits, and a flat distribution can still have a clear winner.)"""
    if margin <= 0:
        return False
    top2 = logits.float().topk(2).values
    return bool(top2[0] - top2[1] < margin)


# --- copy ------------------------------------------------------------------------------------------------
def copy_segments(model: CausalLM, kv_cache: torch.Tensor, kv: CacheRequest) -> None:
    """Copy each reused run's K/V (every layer) into the request's own slots, re-rotating K by the distance it
    moved. kv_cache: [L, 2, num_blocks, block_size, Hkv, D]; the sources stay untouched (the repair rewrites
    the copies)."""
    bs = kv_cache.shape[3]
    slots = kv_cache.view(kv_cache.shape[0], 2, -1, *kv_cache.shape[-2:])            # [L, 2, slots, Hkv, D]
    src_slots, src_pos, dst_pos = [], [], []
    for run in kv.pending.segment_plan.runs:
        for i, block in enumerate(run.blocks):
            src_slots.extend(range(block.block_id * bs, block.block_id * bs + bs))
            src_pos.extend(range(block.position, block.position + bs))
            dst_pos.extend(range(run.start + i * bs, run.start + (i + 1) * bs))
    device = kv_cache.device
    src = torch.tensor(src_slots, device=device)
    dst = torch.tensor([kv.tables.block_table[p // bs] * bs + p % bs for p in dst_pos], device=device)
    deltas = torch.tensor(dst_pos, device=device) - torch.tensor(src_pos, device=device)
    kv_format = format_of(kv_cache)  # an 8-bit K is decoded, moved and encoded again (its V moves as it is)
    keys = kv_format.to_basis(kv_format.decode(slots[:, 0, src], kv_format.value_dtype))  # [L, T, Hkv, D]
    slots[:, 0, dst] = kv_format.encode(kv_format.to_basis(model.rotate_by(keys, deltas)))
    slots[:, 1, dst] = slots[:, 1, src]


# --- one forward -----------------------------------------------------------------------------------------
class BatchRepair:
    """The rows of one forward (sequence b owns rows [bounds[b], bounds[b + 1])) and which of them were reused;
    `select` and `metadata_for` are what `CausalLM.forward_selective` calls back."""

    def __init__(self, seqs: list[Sequence], positions: torch.Tensor, kv_cache: torch.Tensor,
                 settings: SegmentConfig):
        self.seqs, self.positions, self.kv_cache, self.settings = seqs, positions, kv_cache, settings
        lens = torch.tensor([s.num_scheduled_tokens for s in seqs])
        self.bounds = [0, *lens.cumsum(0).tolist()]
        self.row_seq = torch.repeat_interleave(torch.arange(len(seqs)), lens)          # [T] each row's sequence
        self.reused = torch.zeros(self.bounds[-1], dtype=torch.bool)                   # [T]
        self.heads = torch.zeros(self.bounds[-1], dtype=torch.bool)                    # [T]
        for seq, a, b in self.spans():
            if seq.kv.pending.segment_plan is not None:
                self.reused[a:b] = reused_rows(seq.kv.pending.segment_plan, seq.num_computed_tokens, b - a)
                self.heads[a:b] = head_rows(seq.kv.pending.segment_plan, seq.num_computed_tokens, b - a,
                                            settings.head_tokens)
        self.kept: torch.Tensor | None = None                                           # [T'] rows computed

    def spans(self):
        """(sequence, first row, end row) of each sequence."""
        return zip(self.seqs, self.bounds, self.bounds[1:], strict=False)

    def metadata_for(self, rows: torch.Tensor) -> AttentionMetadata:
        """Attention metadata for a subset of the rows (ascending; on any device: the metadata is built on the
        CPU, where the positions are)."""
        rows = rows.cpu()
        per_seq = [self.positions[rows][self.row_seq[rows] == i] for i in range(len(self.seqs))]
        return AttentionMetadata.for_queries(per_seq, [s.kv.tables.block_table for s in self.seqs],
                                             self.kv_cache.shape[3], self.kv_cache.device)

    def select(self, fresh_k: torch.Tensor, fresh_v: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Blend's rows to keep, given the fresh K/V [T, Hkv, D] of layer SELECT_LAYER (before they overwrite
        the reused ones at `slot_mapping` [T])."""
        reused_k, reused_v = self.kv_cache[SELECT_LAYER].unbind(0)
        deviation = kv_deviation(fresh_k, read_kv(reused_k, slot_mapping, fresh_k.dtype), fresh_v,
                                 read_kv(reused_v, slot_mapping, fresh_v.dtype)).cpu()  # [T]
        ratio = self.settings.recompute_ratio
        self.kept = torch.cat([a + select_rows(self.reused[a:b], self.heads[a:b], deviation[a:b], ratio)
                               for _, a, b in self.spans()])
        return self.kept.to(self.kv_cache.device)


def forward_reusing(model: CausalLM, kv_cache: torch.Tensor, seqs: list[Sequence], input_ids: torch.Tensor,
                    positions: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor,
                    settings: SegmentConfig) -> tuple[torch.Tensor, dict[str, RepairOutcome]]:
    """The forward of a batch in which some sequences reuse cached segments (each scheduled whole, so each
    samples); the others (prefill chunks, decodes) are computed in full. input_ids, positions: [T] (positions on
    the CPU); rows: [S] rows of the batch that give logits (every sampling row among them). Returns their final
    hidden states [S, hidden] and the outcome of each reusing sequence, by request id."""
    device = kv_cache.device
    for seq in seqs:
        if seq.kv.pending.segment_plan is not None:
            copy_segments(model, kv_cache, seq.kv)
    batch = BatchRepair(seqs, positions, kv_cache, settings)
    if settings.mode == "shift":
        batch.kept = (~batch.reused).nonzero().flatten()
        hidden = model.hidden_states(input_ids[batch.kept.to(device)], positions[batch.kept].to(device),
                                     ForwardKV.uniform(kv_cache, batch.metadata_for(batch.kept)),
                                     torch.searchsorted(batch.kept, rows).to(device))
    else:
        hidden = model.forward_selective(input_ids, positions.to(device), meta, kv_cache, rows.to(device),
                                         SELECT_LAYER, batch.select, batch.metadata_for)
    recomputed = torch.zeros_like(batch.reused)
    recomputed[batch.kept] = True
    recomputed &= batch.reused                                                          # [T] reused rows redone
    hidden_row_of = {row: i for i, row in enumerate(rows.tolist())}
    outcomes = {}
    for seq, a, b in batch.spans():
        plan = seq.kv.pending.segment_plan
        if plan is None:
            continue
        i = hidden_row_of[b - 1]
        num_recomputed, num_discarded, guarded = int(recomputed[a:b].sum()), 0, False
        if num_recomputed < plan.num_tokens and near_tie(model.compute_logits(hidden[i:i + 1])[0],
                                                         settings.guard_margin):
            hidden[i] = _forward_exact(model, kv_cache, seq, input_ids[a:b], positions[a:b])
            num_discarded = b - a - int(batch.reused[a:b].sum()) + num_recomputed  # the approximate pass's rows
            num_recomputed, guarded = plan.num_tokens, True
        outcomes[seq.request_id] = RepairOutcome(num_recomputed, num_discarded, guarded,
                                                 exact=num_recomputed == plan.num_tokens)
    return hidden, outcomes


def _forward_exact(model: CausalLM, kv_cache: torch.Tensor, seq: Sequence, input_ids: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """Compute one sequence's scheduled rows [n] exactly (overwriting the repaired K/V); its last row's final hidden
    state [hidden]."""
    n = len(input_ids)
    meta = AttentionMetadata.build([seq.num_computed_tokens], [n], [seq.kv.tables.block_table], kv_cache.shape[3],
                                   kv_cache.device)
    return model.hidden_states(input_ids, positions.to(kv_cache.device), ForwardKV.uniform(kv_cache, meta),
                               torch.tensor([n - 1], device=kv_cache.device))[0]
