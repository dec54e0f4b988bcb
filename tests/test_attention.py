"""Paged attention against a plain dense causal reference, over shuffled block tables and GQA."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.kernels import build as kernels
from kvreuse.kvcache.block import NULL_BLOCK as POOL_NULL_BLOCK
from kvreuse.layers.attention import (
    NULL_BLOCK,
    NULL_SLOT,
    AttentionMetadata,
    attend_in_basis,
    paged_attention,
    store_kv,
    store_rows,
)
from kvreuse.layers.kv_format import FORMATS, MODEL_DTYPE_FORMAT, KVFormat, group_size

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 8
SCALE = 0.37  # deliberately not 1/sqrt(HEAD_DIM), so an ignored scale shows up
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- helpers


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: range,
                    scale: float) -> torch.Tensor:
    """One sequence, written out plainly. q: [Q, H, D] for `query_positions`; k/v: [L, Hkv, D] for
    positions 0..L-1. Returns [Q, H * D]. Computed in float64."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    # [L, H, D]: query head h uses kv head h // group
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale       # [H, Q, L]
    qpos = torch.tensor(list(query_positions))[:, None]       # [Q, 1]
    kpos = torch.arange(k.shape[0])[None, :]                  # [1, L]
    scores = scores.masked_fill(~(kpos <= qpos), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)  # [Q, H, D]
    return out.reshape(out.shape[0], -1)


def garbage_pool(num_blocks: int, block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool full of large finite junk: any slot that is read but should be masked changes the result."""
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    return (50 + 10 * torch.randn(shape, generator=gen), -50 + 10 * torch.randn(shape, generator=gen))


def shuffled_tables(context_lens: list[int], block_size: int, rng: random.Random,
                    spare: int = 7) -> tuple[list[list[int]], int]:
    """Non-contiguous block tables drawn at random from a larger pool; returns (tables, pool size)."""
    needed = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(needed) + spare
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, i = [], 0
    for n in needed:
        tables.append(ids[i : i + n])
        i += n
    return tables, num_blocks


def expected_slots(table: list[int], positions: range, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


class Case:
    """Random full-length Q/K/V per sequence plus a paged pool; runs a chunked schedule through the pool."""

    def __init__(self, context_lens: list[int], block_size: int, seed: int):
        self.context_lens, self.block_size = context_lens, block_size
        rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.tables, num_blocks = shuffled_tables(context_lens, block_size, rng)
        self.k_cache, self.v_cache = garbage_pool(num_blocks, block_size, self.gen)
        self.q = [torch.randn(n, NUM_HEADS, HEAD_DIM, generator=self.gen) for n in context_lens]
        self.k = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=self.gen) for n in context_lens]
        self.v = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=self.gen) for n in context_lens]

    def step(self, seqs: list[int], starts: list[int], query_lens: list[int]) -> tuple[torch.Tensor, list]:
        """One forward for sequences `seqs`: store their new K/V, run paged attention.
        Returns (output [T, H*D], per-sequence query position ranges)."""
        tables = [self.tables[b] for b in seqs]
        meta = AttentionMetadata.build(starts, query_lens, tables, self.block_size, CPU)
        ranges = [range(s, s + n) for s, n in zip(starts, query_lens, strict=True)]
        # The slot mapping must be exactly the pool slots of the computed positions.
        want_slots = [s for b, r in zip(seqs, ranges, strict=True)
                      for s in expected_slots(self.tables[b], r, self.block_size)]
        assert meta.slot_mapping.tolist() == want_slots
        q = torch.cat([self.q[b][r.start : r.stop] for b, r in zip(seqs, ranges, strict=True)])
        k = torch.cat([self.k[b][r.start : r.stop] for b, r in zip(seqs, ranges, strict=True)])
        v = torch.cat([self.v[b][r.start : r.stop] for b, r in zip(seqs, ranges, strict=True)])
        store_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
        return paged_attention(q, self.k_cache, self.v_cache, meta, SCALE), ranges

    def check(self, seqs: list[int], out: torch.Tensor, ranges: list[range]) -> None:
        assert out.shape == (sum(len(r) for r in ranges), NUM_HEADS * HEAD_DIM)
        assert out.dtype == torch.float32
        row = 0
        for b, r in zip(seqs, ranges, strict=True):
            want = dense_attention(self.q[b][r.start : r.stop], self.k[b][: r.stop], self.v[b][: r.stop], r,
                                   SCALE)
            got = out[row : row + len(r)]
            assert torch.isfinite(got).all(), f"seq {b}: non-finite output"
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=f"seq {b} rows {r}")
            row += len(r)

    def run_schedule(self, starts: list[int], query_lens: list[int], prefix_chunks: int = 1) -> None:
        """Store positions [0, start) of every sequence in `prefix_chunks` earlier forwards (checking those
        too), then compute [start, start + query_len) and compare with dense attention."""
        done = [0] * len(starts)
        for c in range(prefix_chunks):
            seqs, s_list, n_list = [], [], []
            for b, start in enumerate(starts):
                # Split [0, start) into `prefix_chunks` pieces of roughly equal size.
                end = start * (c + 1) // prefix_chunks
                if end > done[b]:
                    seqs.append(b)
                    s_list.append(done[b])
                    n_list.append(end - done[b])
                    done[b] = end
            if seqs:
                out, ranges = self.step(seqs, s_list, n_list)
                self.check(seqs, out, ranges)
        assert done == starts
        seqs = list(range(len(starts)))
        out, ranges = self.step(seqs, starts, query_lens)
        self.check(seqs, out, ranges)


# ----------------------------------------------------------------------------- explicit cases


def test_dense_reference_sanity():
    # The reference itself: with one key, attention returns that key's value (for every head group).
    q = torch.randn(1, NUM_HEADS, HEAD_DIM)
    k = torch.randn(1, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(1, NUM_KV_HEADS, HEAD_DIM)
    out = dense_attention(q, k, v, range(0, 1), SCALE).view(NUM_HEADS, HEAD_DIM)
    group = NUM_HEADS // NUM_KV_HEADS
    for h in range(NUM_HEADS):
        torch.testing.assert_close(out[h], v[0, h // group].double())


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_from_zero(block_size):
    lens = [1, 3, 5, 17, 33, 64]
    case = Case(lens, block_size, seed=block_size)
    case.run_schedule(starts=[0] * len(lens), query_lens=lens)


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_mid_sequence(block_size):
    # Earlier tokens stored by a previous forward; the new chunk starts mid-block for most sequences.
    starts = [1, 3, 5, 17, 33, 40]
    query_lens = [4, 2, 12, 16, 1, 24]
    case = Case([s + n for s, n in zip(starts, query_lens, strict=True)], block_size, seed=100 + block_size)
    case.run_schedule(starts, query_lens)


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_prefix_in_several_chunks(block_size):
    starts = [2, 9, 31, 47]
    query_lens = [7, 3, 5, 17]
    case = Case([s + n for s, n in zip(starts, query_lens, strict=True)], block_size, seed=200 + block_size)
    case.run_schedule(starts, query_lens, prefix_chunks=3)


@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_batch(block_size):
    # query_len 1 each; context lengths 1, 3, 5, 17, 33, 64 (the new token is the last one).
    lens = [1, 3, 5, 17, 33, 64]
    case = Case(lens, block_size, seed=300 + block_size)
    case.run_schedule(starts=[n - 1 for n in lens], query_lens=[1] * len(lens))


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_prefill_and_decode_batch(block_size):
    # A decode row next to prefill and chunked-prefill rows in one forward.
    starts = [0, 20, 16, 0]
    query_lens = [9, 1, 13, 1]
    case = Case([s + n for s, n in zip(starts, query_lens, strict=True)], block_size, seed=400 + block_size)
    case.run_schedule(starts, query_lens)


def test_block_size_one_and_exact_block_fills():
    # Contexts that end exactly on block boundaries, and a degenerate block size of 1.
    for block_size, lens in [(1, [1, 2, 7]), (4, [4, 8, 16]), (16, [16, 32])]:
        case = Case(lens, block_size, seed=block_size)
        case.run_schedule(starts=[n // 2 for n in lens], query_lens=[n - n // 2 for n in lens])


def test_query_order_within_batch_is_preserved():
    # Batch order in the output is the order of the sequences passed to build, not sorted by length.
    lens = [33, 1, 17, 5]
    case = Case(lens, 4, seed=7)
    case.run_schedule(starts=[0] * 4, query_lens=lens)
    # And the same sequences in another order give the same per-sequence rows.
    case2 = Case(lens, 4, seed=7)
    out_a, _ = case2.step([0, 1, 2, 3], [0] * 4, lens)
    case3 = Case(lens, 4, seed=7)
    out_b, _ = case3.step([3, 2, 1, 0], [0] * 4, lens[::-1])
    cu = [0, 33, 34, 51, 56]
    cu_rev = [0, 5, 22, 23, 56]
    for b, r in zip([0, 1, 2, 3], [3, 2, 1, 0], strict=True):
        torch.testing.assert_close(out_a[cu[b] : cu[b + 1]], out_b[cu_rev[r] : cu_rev[r + 1]])


# ----------------------------------------------------------------------------- property test


@st.composite
def schedules(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5, 16]))
    num_seqs = draw(st.integers(1, 4))
    starts, query_lens = [], []
    for _ in range(num_seqs):
        starts.append(draw(st.integers(0, 40)))
        query_lens.append(draw(st.integers(1, 20)))
    prefix_chunks = draw(st.integers(1, 2))
    seed = draw(st.integers(0, 2**31 - 1))
    return block_size, starts, query_lens, prefix_chunks, seed


@settings(max_examples=30, deadline=None)
@given(schedules())
def test_paged_equals_dense_property(schedule):
    block_size, starts, query_lens, prefix_chunks, seed = schedule
    case = Case([s + n for s, n in zip(starts, query_lens, strict=True)], block_size, seed=seed)
    case.run_schedule(starts, query_lens, prefix_chunks=prefix_chunks)


# ----------------------------------------------------------------------------- store_kv


def test_store_kv_writes_exactly_the_slots():
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size = 9, 4
    k_cache, v_cache = garbage_pool(num_blocks, block_size, gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:13]
    k = torch.randn(13, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(13, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    store_kv(k_cache, v_cache, k, v, slots)

    flat_k, flat_v = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM), v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat_k[slots], k, atol=0, rtol=0)
    torch.testing.assert_close(flat_v[slots], v, atol=0, rtol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], k_before.view(-1, NUM_KV_HEADS, HEAD_DIM)[untouched])
    assert torch.equal(flat_v[untouched], v_before.view(-1, NUM_KV_HEADS, HEAD_DIM)[untouched])
    # The slot -> (block, offset) addressing: slot s is block s // block_size, offset s % block_size.
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s // block_size, s % block_size], k[i])


def test_store_kv_with_built_slot_mapping_touches_only_new_positions():
    block_size = 4
    tables = [[5, 2, 8], [0, 7], [3]]
    starts, query_lens = [6, 0, 2], [3, 5, 1]
    meta = AttentionMetadata.build(starts, query_lens, tables, block_size, CPU)
    assert meta.slot_mapping.tolist() == [
        2 * 4 + 2, 2 * 4 + 3, 8 * 4 + 0,                 # seq 0, positions 6, 7, 8
        0 * 4 + 0, 0 * 4 + 1, 0 * 4 + 2, 0 * 4 + 3, 7 * 4 + 0,  # seq 1, positions 0..4
        3 * 4 + 2,                                       # seq 2, position 2
    ]
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = garbage_pool(10, block_size, gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k = torch.randn(9, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(9, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    changed_k = (k_cache != k_before).flatten(2).any(-1).flatten()  # [num_slots]
    changed_v = (v_cache != v_before).flatten(2).any(-1).flatten()
    assert changed_k.nonzero().flatten().tolist() == sorted(meta.slot_mapping.tolist())
    assert changed_v.nonzero().flatten().tolist() == sorted(meta.slot_mapping.tolist())


# ----------------------------------------------------------------------------- padding


def test_padded_query_rows_are_safe():
    # Very uneven query lengths: most of the padded [B, Q] problem is padding.
    block_size = 4
    starts, query_lens = [0, 0, 12, 30], [1, 23, 1, 2]
    case = Case([s + n for s, n in zip(starts, query_lens, strict=True)], block_size, seed=11)
    meta = AttentionMetadata.build(starts, query_lens, [case.tables[b] for b in range(4)], block_size, CPU)
    # Every row of the padded mask, real or padding, sees at least one key (no all-masked softmax row).
    assert meta.attn_mask.shape == (4, 1, 23, 32)
    assert meta.attn_mask.any(dim=-1).all()
    # Real query rows see exactly keys 0..pos; a sequence never sees keys past its own context.
    for b, (s, n) in enumerate(zip(starts, query_lens, strict=True)):
        for j in range(n):
            row = meta.attn_mask[b, 0, j]
            assert row.nonzero().flatten().tolist() == list(range(s + j + 1))
    # output_index picks exactly the real rows, in batch order.
    assert meta.output_index.tolist() == [b * 23 + j for b, n in enumerate(query_lens) for j in range(n)]
    case.run_schedule(starts, query_lens)
    # Run again over the same pool: the padded rows still leave every real row equal to dense attention.
    out, ranges = case.step([0, 1, 2, 3], starts, query_lens)
    assert out.shape[0] == sum(query_lens)
    case.check([0, 1, 2, 3], out, ranges)


def test_ragged_tables_and_passed_window_blocks_read_the_null_block_only_masked():
    assert NULL_BLOCK == POOL_NULL_BLOCK and NULL_SLOT // 4 == NULL_BLOCK
    null_slots = range(NULL_BLOCK * 4, NULL_BLOCK * 4 + 4)
    # Sequence 0's window passed its first two blocks; sequence 1's table is one block, padded.
    decode = AttentionMetadata.build([15, 2], [1, 1], [[NULL_BLOCK, NULL_BLOCK, 5, 6], [7]], 4, CPU)
    assert decode.context_slots[1, 3:].tolist() == [NULL_SLOT] * 13
    window = decode.windowed(5)  # sequence 0 reads keys 11..15: blocks 5 and 6 only
    visible = window.context_slots[window.attn_mask[:, 0, 0]]
    assert visible.tolist() == [23, 24, 25, 26, 27, 28, 29, 30]
    prefill = AttentionMetadata.build([0, 0], [5, 2], [[3, 4], [6]], 4, CPU)
    assert prefill.context_slots[1, 2:].tolist() == [NULL_SLOT] * 3
    assert not any(s in null_slots for s in prefill.context_slots[prefill.attn_mask[:, 0].any(1)].tolist())


# ----------------------------------------------------------------------------- the fused decode kernel


needs_kernels = pytest.mark.skipif(not kernels.load().loaded, reason=f"kernels not loaded: {kernels.load().reason}")


KV_FORMATS = ("plain", "bf16", "int8", "fp8")  # plain: a pool of q's own dtype (fp32 or bf16); bf16 under fp32 q


def kv_format_for(name: str, dtype: torch.dtype) -> KVFormat:
    return FORMATS[MODEL_DTYPE_FORMAT[dtype] if name == "plain" else name]


@needs_kernels
@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("context_lens", [[1], [5], [37, 100, 3], [17] * 8, [300, 1]])
@pytest.mark.parametrize("heads", [(6, 2, 8), (9, 3, 64), (4, 4, 16), (8, 1, 256)],
                         ids=["gqa3", "smollm2", "mha", "d256"])
def test_fused_decode_attention_equals_the_torch_ops(context_lens, heads, dtype, kv):
    num_heads, num_kv_heads, head_dim = heads
    if head_dim > 64 and dtype == torch.bfloat16:
        pytest.skip("bf16 SDPA's own roundings of 256-term scores exceed a bf16 step: fp32 checks head_dim 256")
    if kv == "bf16" and dtype == torch.bfloat16:
        pytest.skip("a bf16 pool under bf16 queries is the plain case")
    kv_format = kv_format_for(kv, dtype)
    gen = torch.Generator().manual_seed(sum(context_lens))
    num_blocks, block_size = 64, 16
    tables = [torch.randperm(num_blocks, generator=gen)[: -(-n // block_size)].tolist() for n in context_lens]
    meta = AttentionMetadata.for_decode(context_lens, tables, block_size, CPU)
    k_cache = kv_format.encode(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype))
    v_cache = kv_format.encode(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype))
    # scores of the spread smollm2's head_dim 64 gives (SCALE * 8 standard deviations) at head_dim 256 too
    q = (torch.randn(len(context_lens), num_heads, head_dim, generator=gen) * min(1.0, (64 / head_dim) ** 0.5))
    q = q.to(dtype)
    k, v = (torch.randn(len(context_lens), num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    out = torch.ops.kvreuse_cpu.decode_attention(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.context_slots,
                                                 meta.context_lens, SCALE)
    # the kernel works in the pool's basis (q, k and v come into it before the call, in store_and_attend)
    store_rows(k_ref, v_ref, k, v, meta.slot_mapping)
    expected = attend_in_basis(q, k_ref, v_ref, meta, SCALE)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), "the new K/V were not stored as store_kv does"
    assert out.dtype == dtype
    # fp32: summation order only (an 8-bit pool's values are code * scale in fp32 on both paths; the kernel sums a
    # row's groups apart, and head_dim 256 sums 4x the terms: twice the plain bound each). bf16: both compute in fp32
    # and round the output once, so within one bf16 step; the torch path also rounds 8-bit values to bf16 first.
    if dtype == torch.float32:
        atol, rtol = 2e-6 * (1 if kv in ("plain", "bf16") else 2) * (1 if head_dim <= 64 else 2), 0.0
    else:
        atol, rtol = 2e-2, 0.0 if kv == "plain" else 2**-8
    torch.testing.assert_close(out.float(), expected.float(), rtol=rtol, atol=atol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 256, 8])
@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_fused_decode_attention_encodes_8_bit_rows_as_store_kv_does(name, head_dim, dtype):
    """The kernel's encoder against KVFormat.encode, byte for byte: random rows at scales from 1e-30 to 1e30 (fp16's
    scale range clamps both ends), all-zero groups, single huge values, infinities."""
    kv_format, num_kv_heads, group = FORMATS[name], 2, group_size(head_dim)
    gen = torch.Generator().manual_seed(head_dim)
    magnitudes = torch.tensor([0.0, 1e-30, 1e-8, 1e-5, 1e-3, 1.0, 7.0, 300.0, 6e4, 1e6, 1e30])
    num_seqs = 4 * len(magnitudes)
    x = torch.randn(2, num_seqs, num_kv_heads, head_dim, generator=gen)
    x *= magnitudes.repeat(4)[None, :, None, None]
    x[:, 0::3, 0, :group] = 0                                                      # an all-zero group
    x[:, 1::5, 1, group // 2] = 3e38                                               # one huge value in a group
    x[:, 2::7, 0, -1] = -float("inf") if dtype == torch.float32 else -3e38
    x = x.to(dtype)
    k, v = x[0].contiguous(), x[1].contiguous()
    num_blocks, block_size = num_seqs + 1, 1
    meta = AttentionMetadata.for_decode([1] * num_seqs, [[b + 1] for b in range(num_seqs)], block_size, CPU)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, kv_format.row_width(head_dim),
                          dtype=kv_format.storage)
    v_cache, k_ref, v_ref = k_cache.clone(), k_cache.clone(), k_cache.clone()
    q = torch.randn(num_seqs, 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    torch.ops.kvreuse_cpu.decode_attention(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.context_slots,
                                           meta.context_lens, SCALE)
    store_rows(k_ref, v_ref, k, v, meta.slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def fp8_cast_probes() -> torch.Tensor:
    """Values whose float8_e4m3fn cast is easy to get wrong: every code's value, the midpoints between neighbours
    (ties, which round to the even code), a hair either side of them, subnormals and their ties, and random values,
    all within +-448 (an encoder clamps to it first)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[codes.isfinite() & (codes >= 0)].sort().values                  # 0 .. 448, 127 of them
    mids = (values[1:] + values[:-1]) / 2
    probes = torch.cat([values, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                        torch.linspace(0, 2**-6, 257), torch.rand(4000, generator=torch.Generator().manual_seed(0))
                        * 448, torch.tensor([1e-45, 2**-10, 3 * 2**-11, 2**-9 * 0.75, 447.99])])
    return torch.cat([probes, -probes])


def rows_of_scale_one(probes: torch.Tensor, largest: float) -> torch.Tensor:
    """`probes` in rows [N, 1, 64] whose groups of 32 each end in `largest` (the largest code: scale 1 exactly), so
    that an encoder's codes are its cast of the probes themselves; zeros pad the last row."""
    num_groups = -(-len(probes) // 31)
    num_groups += num_groups % 2
    values = torch.zeros(num_groups * 31)
    values[: len(probes)] = probes
    return torch.cat([values.view(num_groups, 31), torch.full((num_groups, 1), largest)], dim=1).view(-1, 1, 64)


def encode_with_the_kernel(rows: torch.Tensor, kv_format: KVFormat) -> torch.Tensor:
    """rows [N, 1, D] fp32 -> the [N, 1, W] rows the fused kernel stores for them (as new K and V, one per sequence)."""
    num_seqs, _, head_dim = rows.shape
    meta = AttentionMetadata.for_decode([1] * num_seqs, [[b + 1] for b in range(num_seqs)], 1, CPU)
    k_cache = torch.zeros(num_seqs + 1, 1, 1, kv_format.row_width(head_dim), dtype=kv_format.storage)
    v_cache = k_cache.clone()
    torch.ops.kvreuse_cpu.decode_attention(rows, rows, rows, k_cache, v_cache, meta.slot_mapping,
                                           meta.context_slots, meta.context_lens, SCALE)
    assert torch.equal(k_cache, v_cache)
    return k_cache[1:, 0]


@needs_kernels
def test_the_fused_fp8_encoder_casts_as_torch_does():
    """The stored codes must be torch's float -> float8_e4m3fn cast (round to nearest, ties to even) of each value."""
    fp8 = FORMATS["fp8"]
    rows = rows_of_scale_one(fp8_cast_probes(), 448.0)
    stored = encode_with_the_kernel(rows, fp8)                                     # [N, 1, 68]
    assert torch.equal(stored[..., 64:].view(torch.float16), torch.ones(len(rows), 1, 2, dtype=torch.float16))
    assert torch.equal(stored[..., :64], rows.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(stored, fp8.encode(rows))


@needs_kernels
def test_the_fused_int8_encoder_rounds_half_to_even():
    """The codes are the values rounded, ties to the even code, as torch.round."""
    halves = torch.arange(-127, 127) + 0.5                                          # 254 ties
    probes = torch.cat([halves, halves.nextafter(torch.tensor(0.0)), halves.nextafter(torch.tensor(1e9))])
    rows = rows_of_scale_one(probes, 127.0)
    stored = encode_with_the_kernel(rows, FORMATS["int8"])
    assert torch.equal(stored[..., :64], rows.round().to(torch.int8))
    assert torch.equal(stored, FORMATS["int8"].encode(rows))


@needs_kernels
def test_fused_decode_attention_refuses_slots_outside_the_pool():
    k_cache = v_cache = torch.zeros(4, 16, 2, 8)
    meta = AttentionMetadata.for_decode([3], [[1]], 16, CPU)
    q, k = torch.zeros(1, 6, 8), torch.zeros(1, 2, 8)
    bad = meta.context_slots.clone()
    bad[0, 1] = 4 * 16
    with pytest.raises(RuntimeError, match="outside the pool"):
        torch.ops.kvreuse_cpu.decode_attention(q, k, k, k_cache, v_cache, meta.slot_mapping, bad, meta.context_lens,
                                               SCALE)
    assert not k_cache.any(), "a refused call wrote the pool"
