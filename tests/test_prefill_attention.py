"""Prompt attention one query row at a time (layers/row_attention.py, kernels/prefill_attention.cpp): a row's bits
do not depend on how many rows its step holds or which rows sit beside it, and equal the decode kernel's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvreuse.kernels import build as kernels
from kvreuse.layers.attention import AttentionMetadata, padded_attention, paged_attention
from kvreuse.layers.kv_format import FORMATS, format_of
from kvreuse.layers.row_attention import attend_rows, attend_rows_in_torch

CPU = torch.device("cpu")
BLOCK_SIZE, NUM_BLOCKS = 16, 48
HEADS = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # (H, Hkv, D)
needs_kernels = pytest.mark.skipif(not kernels.load().loaded, reason=f"kernels not loaded: {kernels.load().reason}")


class Pool:
    """A shuffled pool holding `lengths` tokens of K/V per sequence, in `kv_dtype`, and every position's query."""

    def __init__(self, heads: tuple[int, int, int], lengths: list[int], kv_dtype: str = "fp32", seed: int = 0):
        num_heads, num_kv_heads, head_dim = heads
        gen = torch.Generator().manual_seed(seed)
        kv_format = FORMATS[kv_dtype]
        order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
        self.tables, used = [], 0
        for n in lengths:
            blocks = -(-n // BLOCK_SIZE)
            self.tables.append(order[used:used + blocks])
            used += blocks
        shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
        self.k_cache = kv_format.encode(torch.randn(shape, generator=gen))
        self.v_cache = kv_format.encode(torch.randn(shape, generator=gen))
        self.q = [torch.randn(n, num_heads, head_dim, generator=gen) * (64 / head_dim) ** 0.5 for n in lengths]
        self.scale = head_dim ** -0.5

    def step(self, rows: dict[int, range]) -> AttentionMetadata:
        """Metadata for sequences rows.keys() computing positions rows[b] (ascending)."""
        seqs = list(rows)
        return AttentionMetadata.for_queries([torch.tensor(list(rows[b])) for b in seqs],
                                             [self.tables[b] for b in seqs], BLOCK_SIZE, CPU)

    def attend(self, rows: dict[int, range], window: int = 0, torch_ops: bool = False) -> torch.Tensor:
        """[T, H * D]: the rows' attention in batch order, through the op (or the torch ops)."""
        meta = self.step(rows)
        q = torch.cat([self.q[b][list(r)] for b, r in rows.items()])
        row_seq, row_pos = meta.rows()
        attend = attend_rows_in_torch if torch_ops else attend_rows
        return attend(q, self.k_cache, self.v_cache, meta.context_slots, row_seq, row_pos, self.scale, window)


def steps_holding(position: int, length: int) -> list[dict[int, range]]:
    """Steps of sequence 0 whose rows include `position`: 1 .. N rows ending at or after it, with and without a
    second sequence beside it."""
    steps = [{0: range(start, min(length, position + after + 1))}
             for start in (position, position - 1, position - 7, 0, position - 33)
             for after in (0, 3) if start >= 0]
    steps += [{1: range(0, 20), 0: range(max(0, position - 5), position + 1)}, {0: range(position, position + 1),
                                                                              1: range(59, 60)}]
    return steps


def row_of(step: dict[int, range], out: torch.Tensor, position: int) -> torch.Tensor:
    at = 0
    for b, r in step.items():
        if b == 0:
            return out[at + list(r).index(position)]
        at += len(r)
    raise AssertionError("sequence 0 is not in the step")


@pytest.mark.parametrize("torch_ops", [False, True], ids=["kernel", "torch"])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_a_rows_bits_do_not_depend_on_its_step(heads, window, torch_ops):
    if not torch_ops and not kernels.load().loaded:
        pytest.skip(f"kernels not loaded: {kernels.load().reason}")
    pool = Pool(heads, [90, 60])
    for position in (0, 15, 40, 77):
        alone = pool.attend({0: range(position, position + 1)}, window, torch_ops)[0]
        for step in steps_holding(position, 90):
            got = row_of(step, pool.attend(step, window, torch_ops), position)
            assert torch.equal(got, alone), f"position {position} in step {step}"


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "fp8"])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_the_kernel_computes_what_the_torch_ops_do(heads, window, kv_dtype):
    pool = Pool(heads, [90, 60], kv_dtype)
    step = {0: range(10, 90), 1: range(0, 60)}
    torch.testing.assert_close(pool.attend(step, window), pool.attend(step, window, torch_ops=True),
                               atol=4e-6, rtol=0.0)


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_a_prompt_row_gets_the_bits_of_a_decode_row(heads, window, kv_dtype):
    """A decode row riding along with a prompt chunk is computed as a decode step computes it (fp32 queries: over
    bf16 rows too, an fp32 model with `cache.kv_dtype=bf16`)."""
    pool = Pool(heads, [90, 60], kv_dtype)
    prompt = pool.attend({0: range(30, 90), 1: range(0, 60)}, window)
    lengths = [90, 60]
    decode = AttentionMetadata.for_decode(lengths, pool.tables, BLOCK_SIZE, CPU).windowed(window or None)
    q = torch.stack([pool.q[0][89], pool.q[1][59]])                                   # [2, H, D]
    # the decode kernel writes the new rows' K/V: give it the values already stored at those slots
    fmt = FORMATS[kv_dtype]
    rows = pool.k_cache.view(-1, *pool.k_cache.shape[-2:])
    k = fmt.decode(rows[decode.slot_mapping], torch.float32).contiguous()
    v = fmt.decode(pool.v_cache.view(-1, *pool.v_cache.shape[-2:])[decode.slot_mapping], torch.float32).contiguous()
    k_cache, v_cache = pool.k_cache.clone(), pool.v_cache.clone()
    out = torch.ops.kvreuse_cpu.decode_attention(q, k, v, k_cache, v_cache, decode.slot_mapping,
                                                 decode.context_slots, decode.context_lens, pool.scale)
    assert torch.equal(k_cache, pool.k_cache), "re-encoding a stored row changed it"
    assert torch.equal(out[0], prompt[59]) and torch.equal(out[1], prompt[-1])


@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_paged_attention_takes_the_rows_on_a_cpu_and_equals_sdpa_up_to_rounding(heads, window):
    """SDPA over the padded batch (what CUDA runs) against the row-by-row path, a prompt in chunks over a window."""
    pool = Pool(heads, [90, 60])
    step = {0: range(10, 90), 1: range(0, 60)}
    meta = pool.step(step)
    q = torch.cat([pool.q[b][list(r)] for b, r in step.items()])                      # [140, H, D]
    rows = paged_attention(q, pool.k_cache, pool.v_cache, meta, pool.scale, window or None)
    assert torch.equal(rows, pool.attend(step, window))
    sdpa = padded_attention(q, pool.k_cache, pool.v_cache, meta, pool.scale, window or None)
    torch.testing.assert_close(rows, sdpa, atol=4e-6, rtol=0.0)
    one = {0: range(0, 90)}  # one sequence from position 0: SDPA's causal path, and a window's chunks
    meta = pool.step(one)
    q = pool.q[0]
    torch.testing.assert_close(paged_attention(q, pool.k_cache, pool.v_cache, meta, pool.scale, window or None),
                               padded_attention(q, pool.k_cache, pool.v_cache, meta, pool.scale, window or None),
                               atol=4e-6, rtol=0.0)


@needs_kernels
def test_the_op_has_a_fake_function_so_a_compiled_graph_can_call_it():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.kvreuse_cpu.prefill_attention(torch.empty(5, 4, 16), torch.empty(8, 4, 2, 16),
                                                      torch.empty(8, 4, 2, 16), torch.empty(1, 5, dtype=torch.long),
                                                      torch.zeros(5, dtype=torch.long),
                                                      torch.arange(5), 0, 0.25)
    assert tuple(out.shape) == (5, 64)


@needs_kernels
def test_the_op_refuses_a_position_outside_its_context():
    pool = Pool(HEADS["smollm2"], [20])
    meta = pool.step({0: range(0, 20)})
    row_seq, row_pos = meta.rows()
    with pytest.raises(RuntimeError, match="outside context_slots"):
        torch.ops.kvreuse_cpu.prefill_attention(pool.q[0], pool.k_cache, pool.v_cache, meta.context_slots, row_seq,
                                                row_pos + 1, 0, pool.scale)


@needs_kernels
@pytest.mark.parametrize("heads", list(HEADS.values()), ids=list(HEADS))
def test_in_bf16_a_row_is_as_invariant_and_rounds_the_fp32_rows_once(heads):
    """bf16 queries over a bf16 pool: the row is computed in fp32 and its output rounded once. Where the kernels take
    the bf16 dot products (AVX-512 BF16), a score sums its products in pairs: the fp32 row's up to that order."""
    pool = Pool(heads, [90, 60], "bf16")
    pool.q = [q.bfloat16() for q in pool.q]
    step = {1: range(0, 60), 0: range(40, 90)}
    whole = pool.attend(step, 24)                                                     # [110, H * D]
    for position in (40, 77, 89):
        assert torch.equal(pool.attend({0: range(position, position + 1)}, 24)[0], whole[60 + position - 40])
    pool.k_cache, pool.v_cache, pool.q = pool.k_cache.float(), pool.v_cache.float(), [q.float() for q in pool.q]
    fp32_rows = pool.attend(step, 24).bfloat16()
    if torch.ops.kvreuse_cpu.bf16_dot():
        assert not torch.equal(whole, fp32_rows), "the bf16 dot products summed as fp32 FMAs do"
        torch.testing.assert_close(whole, fp32_rows, rtol=2 ** -7, atol=2 ** -12)  # a bf16 step at most
    else:
        assert torch.equal(whole, fp32_rows)


@needs_kernels
@pytest.mark.skipif(not kernels.load().loaded or not torch.ops.kvreuse_cpu.bf16_dot(),
                    reason="this CPU has no AVX-512 BF16: the bf16 tests above run the fp32 products already")
def test_the_bf16_tests_pass_without_the_bf16_dot_products():
    """KVREUSE_BF16_DOT=0 gives a bf16 pool the fp32 products every other CPU runs, in both kernels alike."""
    env = {**os.environ, "KVREUSE_BF16_DOT": "0"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "bf16 and not without"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


def decode_row(pool: Pool, b: int, position: int, window: int) -> torch.Tensor:
    """[H * D]: sequence b's row at `position` as a decode step computes it (the decode kernel over the same pool)."""
    decode = AttentionMetadata.for_decode([position + 1], [pool.tables[b]], BLOCK_SIZE, CPU).windowed(window or None)
    q = pool.q[b][position:position + 1]                                              # [1, H, D]
    fmt = format_of(pool.k_cache)
    k, v = (fmt.decode(cache.view(-1, *cache.shape[-2:])[decode.slot_mapping], q.dtype).contiguous()
            for cache in (pool.k_cache, pool.v_cache))
    k_cache, v_cache = pool.k_cache.clone(), pool.v_cache.clone()
    out = torch.ops.kvreuse_cpu.decode_attention(q, k, v, k_cache, v_cache, decode.slot_mapping,
                                                 decode.context_slots, decode.context_lens, pool.scale)
    assert torch.equal(k_cache, pool.k_cache) and torch.equal(v_cache, pool.v_cache), "re-encoding changed a row"
    return out[0]


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8", "fp8"])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256), (8, 2, 128), (6, 3, 8), (2, 2, 256)],
                         ids=["smollm2", "gemma3", "d128", "d8", "mha"])
def test_rows_sharing_a_tile_each_get_the_bits_they_get_alone(heads, window, kv_dtype):
    """The op tiles a sequence's consecutive rows (~12 query heads a tile) so that they share each key and value row
    it loads: rows of different lengths in one tile, tiles' tails (87 and 5 rows), three sequences in a step, a
    window, GQA groups and every head_dim path. Each row must equal the decode kernel's row, bit for bit."""
    pool = Pool(heads, [90, 60, 30], kv_dtype)
    if kv_dtype == "bf16":
        pool.q = [q.bfloat16() for q in pool.q]
    step = {0: range(3, 90), 1: range(0, 60), 2: range(25, 30)}
    out = pool.attend(step, window)
    at = 0
    for b, positions in step.items():
        for position in positions:
            assert torch.equal(out[at], decode_row(pool, b, position, window)), f"sequence {b}, position {position}"
            at += 1
