"""Repairing reused K/V (selective recomputation): which reused tokens to compute again.

Beyond layer 0 a reused block's K/V depend on the text it was computed after, so reusing it in another
context is an approximation (see DESIGN.md section 1). Blend mode computes layers 0 and 1 for every
token, then at the deeper layers recomputes only the tokens most likely to be wrong:
- the first `head_tokens` of each reused run (EPIC: a chunk start carries a false attention sink), and
- the top `recompute_ratio` of the remaining reused tokens by how far their fresh layer-1 K and V are
  from the reused ones (CacheBlend's KV deviation),
plus every token that was not reused. `recompute_ratio = 1.0` recomputes everything: exact output.
"""

from __future__ import annotations

import math

import torch

from kvreuse.kvcache.segment import SegmentPlan


def reused_rows(plan: SegmentPlan, region_start: int, num_rows: int) -> torch.Tensor:
    """Boolean [num_rows]: which rows of the region [region_start, region_start + num_rows) were reused."""
    mask = torch.zeros(num_rows, dtype=torch.bool)
    for run in plan.runs:
        mask[run.start - region_start: run.start - region_start + run.num_tokens] = True
    return mask


def head_rows(plan: SegmentPlan, region_start: int, num_rows: int, head_tokens: int) -> torch.Tensor:
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
