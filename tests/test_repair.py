"""The repair policy without a model: which rows blend recomputes, and when the near-tie guard fires."""

from __future__ import annotations

import math

import pytest
import torch

from kvreuse.engine.repair import head_rows, kv_deviation, near_tie, reused_rows, select_rows
from kvreuse.kvcache.block import KVCacheBlock
from kvreuse.kvcache.segment import SegmentPlan, SegmentRun

BS = 4


def run_at(start: int, num_blocks: int, source_position: int = 0) -> SegmentRun:
    blocks = [KVCacheBlock(i, token_ids=tuple(range(BS)), position=source_position + i * BS) for i in range(num_blocks)]
    return SegmentRun(start, blocks)


def test_reused_and_head_rows_mark_each_run_relative_to_the_region():
    plan = SegmentPlan([run_at(10, 2), run_at(22, 1)])        # tokens 10..17 and 22..25
    reused = reused_rows(plan, region_start=8, num_rows=20)     # rows cover positions 8..27
    assert reused.nonzero().flatten().tolist() == [*range(2, 10), *range(14, 18)]
    heads = head_rows(plan, region_start=8, num_rows=20, head_tokens=3)
    assert heads.nonzero().flatten().tolist() == [2, 3, 4, 14, 15, 16]
    # A head longer than its run stops at the run's end.
    assert head_rows(plan, 8, 20, head_tokens=6).nonzero().flatten().tolist() == [*range(2, 8), *range(14, 18)]


def test_select_rows_keeps_fresh_rows_heads_and_the_most_deviating_share_of_the_rest():
    reused = torch.tensor([False, True, True, True, True, True, True, False])
    heads = torch.tensor([False, True, False, False, False, False, False, False])
    deviation = torch.tensor([0.0, 0.0, 0.1, 0.9, 0.2, 0.8, 0.3, 0.0])
    # Candidates are rows 2..6 (reused, not heads): 40% of 5 is 2 rows, the two most deviating: 3 and 5.
    assert select_rows(reused, heads, deviation, 0.4).tolist() == [0, 1, 3, 5, 7]
    assert select_rows(reused, heads, deviation, 0.0).tolist() == [0, 1, 7]
    assert select_rows(reused, heads, deviation, 1.0).tolist() == list(range(8))
    # The share rounds up: any positive ratio recomputes at least one candidate.
    assert select_rows(reused, heads, deviation, 0.01).tolist() == [0, 1, 3, 7]


def test_kv_deviation_is_relative_and_sums_k_and_v():
    k = torch.ones(3, 2, 4)
    v = torch.full((3, 2, 4), 2.0)
    fresh_k, fresh_v = k.clone(), v.clone()
    fresh_k[1] *= 1.5                      # K 50% off
    fresh_v[2] *= 0.0                      # V 100% off
    assert kv_deviation(fresh_k, k, fresh_v, v).tolist() == pytest.approx([0.0, 0.5, 1.0])


@pytest.mark.parametrize(("gap", "margin", "fires"), [
    (0.01, 0.03, True), (0.05, 0.03, False), (0.0, 0.03, True), (0.01, 0.0, False), (50.0, 100.0, True)])
def test_the_guard_fires_on_a_log_probability_gap_below_the_margin(gap, margin, fires):
    logits = torch.tensor([1.0, 3.0 - gap, -2.0, 3.0])
    assert near_tie(logits, margin) is fires


def test_the_guard_reads_logits_not_probabilities():
    # A flat distribution (top probability ~1e-3) whose top two are far apart in log space is not a near-tie.
    logits = torch.zeros(1000)
    logits[0], logits[1] = 1.0, 0.5
    top = torch.softmax(logits, -1).topk(2).values
    assert float(top[0] - top[1]) < 0.03 and not near_tie(logits, 0.03)
    assert math.isclose(float(logits.topk(2).values.diff().abs()), 0.5)
