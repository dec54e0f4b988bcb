"""Rotary embedding: identity at position 0, composition of rotations (what segment reuse relies on)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.layers.rotary import RotaryEmbedding, apply_rotary, rotate_half

HEAD_DIM, MAX_POS, THETA = 64, 4096, 10000.0


@pytest.fixture(scope="module")
def rope() -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, MAX_POS, THETA)


def at(rope: RotaryEmbedding, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return rope.cos_sin(torch.tensor(positions), torch.float32)


def test_rotate_half_layout():
    x = torch.arange(1.0, 9.0).view(1, 1, 8)
    assert rotate_half(x).flatten().tolist() == [-5.0, -6.0, -7.0, -8.0, 1.0, 2.0, 3.0, 4.0]


def test_table_values(rope):
    # Pair i (dims i and i + D/2) rotates at frequency theta^(-2i/D).
    cos, sin = at(rope, [0, 1, 7])
    assert cos.shape == sin.shape == (3, 1, HEAD_DIM)
    for row, p in enumerate([0, 1, 7]):
        for i in range(HEAD_DIM // 2):
            angle = p * THETA ** (-2 * i / HEAD_DIM)
            for d in (i, i + HEAD_DIM // 2):
                assert cos[row, 0, d].item() == pytest.approx(math.cos(angle), abs=1e-6)
                assert sin[row, 0, d].item() == pytest.approx(math.sin(angle), abs=1e-6)


def test_matches_explicit_2d_rotation(rope):
    # apply_rotary rotates each pair (x[i], x[i + D/2]) by the angle of position p.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, HEAD_DIM, generator=gen)
    p = 13
    out = apply_rotary(x, *at(rope, [p]))
    half = HEAD_DIM // 2
    for i in range(half):
        a = p * THETA ** (-2 * i / HEAD_DIM)
        x1, x2 = x[0, :, i].double(), x[0, :, i + half].double()
        torch.testing.assert_close(out[0, :, i].double(), x1 * math.cos(a) - x2 * math.sin(a),
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(out[0, :, i + half].double(), x2 * math.cos(a) + x1 * math.sin(a),
                                   atol=1e-5, rtol=0)


def test_position_zero_is_identity(rope):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, HEAD_DIM, generator=gen)
    cos, sin = at(rope, [0] * 5)
    assert torch.equal(cos, torch.ones_like(cos))
    assert torch.equal(sin, torch.zeros_like(sin))
    torch.testing.assert_close(apply_rotary(x, cos, sin), x, atol=0, rtol=0)


def test_rotation_preserves_norm_of_each_pair(rope):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 2, HEAD_DIM, generator=gen)
    out = apply_rotary(x, *at(rope, [1, 50, 999, 4000]))
    half = HEAD_DIM // 2
    pair_norm = lambda t: t[..., :half] ** 2 + t[..., half:] ** 2
    torch.testing.assert_close(pair_norm(out), pair_norm(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("p,q", [(0, 0), (0, 9), (3, 3), (3, 17), (5, 40), (17, 100), (64, 128), (100, 127)])
def test_rerotation_equals_direct_rotation(rope, p, q):
    # K cached at position p, moved to position q by rotating by (q - p): must equal K rotated at q.
    gen = torch.Generator().manual_seed(p * 1000 + q)
    x = torch.randn(3, 4, HEAD_DIM, generator=gen)
    moved = apply_rotary(apply_rotary(x, *at(rope, [p] * 3)), *at(rope, [q - p] * 3))
    direct = apply_rotary(x, *at(rope, [q] * 3))
    torch.testing.assert_close(moved, direct, atol=1e-5, rtol=0)


def test_rerotation_per_token_positions(rope):
    # Several tokens at once, each with its own (p, q), as a reused segment would be moved.
    gen = torch.Generator().manual_seed(3)
    ps = [0, 1, 2, 7, 30, 31, 60]
    qs = [5, 6, 7, 12, 100, 101, 120]
    x = torch.randn(len(ps), 2, HEAD_DIM, generator=gen)
    shifts = [q - p for p, q in zip(ps, qs, strict=True)]
    moved = apply_rotary(apply_rotary(x, *at(rope, ps)), *at(rope, shifts))
    torch.testing.assert_close(moved, apply_rotary(x, *at(rope, qs)), atol=1e-5, rtol=0)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(0, 64), shift=st.integers(0, 64), seed=st.integers(0, 2**31 - 1))
def test_rerotation_property(rope, p, shift, seed):
    # Inputs in [-1, 1] and positions <= 128: there fp32 angle rounding stays well under 1e-5 (see below).
    x = torch.rand(1, 2, HEAD_DIM, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    moved = apply_rotary(apply_rotary(x, *at(rope, [p])), *at(rope, [shift]))
    torch.testing.assert_close(moved, apply_rotary(x, *at(rope, [p + shift])), atol=1e-5, rtol=0)


def test_rerotation_far_positions_within_float32_table_precision(rope):
    # The table holds fp32 angles (position * inv_freq rounded to fp32), so at positions in the
    # thousands the composition is only as exact as fp32 angle rounding: ~1e-4 for unit-scale
    # inputs, well below bf16 resolution. This pins that error bound so a regression shows up.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 4, HEAD_DIM, generator=gen)
    for p, q in [(100, 1000), (1000, 4000), (2500, 4095)]:
        moved = apply_rotary(apply_rotary(x, *at(rope, [p])), *at(rope, [q - p]))
        torch.testing.assert_close(moved, apply_rotary(x, *at(rope, [q])), atol=1e-3, rtol=0)


def test_cos_sin_casts_to_requested_dtype(rope):
    cos, sin = rope.cos_sin(torch.tensor([0, 5]), torch.bfloat16)
    assert cos.dtype == sin.dtype == torch.bfloat16
    assert cos.shape == (2, 1, HEAD_DIM)
    ref_cos, ref_sin = at(rope, [0, 5])
    torch.testing.assert_close(cos.float(), ref_cos, atol=1e-2, rtol=0)
    torch.testing.assert_close(sin.float(), ref_sin, atol=1e-2, rtol=0)


# --- rotate_by: moving already-rotated keys, forwards and backwards ------------------------------------------------
def rotated_at(rope: RotaryEmbedding, x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    return apply_rotary(x, *at(rope, positions))


@pytest.mark.parametrize("p,d", [(0, 5), (10, 7), (40, -40), (100, -3), (127, -100), (64, -1), (9, 0)])
def test_rotate_by_equals_rotating_at_the_new_position(rope, p, d):
    # Negative deltas move a key to an earlier position (a segment that moved towards the start of the prompt).
    gen = torch.Generator().manual_seed(100 + p)
    x = torch.randn(3, 4, HEAD_DIM, generator=gen)
    moved = rope.rotate_by(rotated_at(rope, x, [p] * 3), torch.tensor([d] * 3))
    torch.testing.assert_close(moved, rotated_at(rope, x, [p + d] * 3), atol=1e-5, rtol=0)


def test_rotate_by_per_token_deltas_of_both_signs(rope):
    gen = torch.Generator().manual_seed(5)
    ps = [3, 50, 50, 120, 7, 0]
    qs = [0, 20, 90, 121, 7, 64]
    x = torch.randn(len(ps), 2, HEAD_DIM, generator=gen)
    deltas = torch.tensor([q - p for p, q in zip(ps, qs, strict=True)])
    assert (deltas < 0).any() and (deltas > 0).any() and (deltas == 0).any()
    moved = rope.rotate_by(rotated_at(rope, x, ps), deltas)
    torch.testing.assert_close(moved, rotated_at(rope, x, qs), atol=1e-5, rtol=0)


def test_rotate_by_a_leading_batch_dimension(rope):
    # k may carry leading dimensions ([..., T, Hkv, D]), e.g. layers stacked in front.
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 4, HEAD_DIM, generator=gen)
    deltas = torch.tensor([-2, 0, 9])
    moved = rope.rotate_by(x, deltas)
    for layer in range(2):
        torch.testing.assert_close(moved[layer], rope.rotate_by(x[layer], deltas), atol=0, rtol=0)


@settings(max_examples=30, deadline=None)
@given(deltas=st.lists(st.integers(-128, 128), min_size=1, max_size=6), seed=st.integers(0, 2**31 - 1))
def test_rotate_by_then_back_is_the_identity(rope, deltas, seed):
    x = torch.rand(len(deltas), 2, HEAD_DIM, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    d = torch.tensor(deltas)
    torch.testing.assert_close(rope.rotate_by(rope.rotate_by(x, d), -d), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(rope.rotate_by(rope.rotate_by(x, -d), d), x, atol=1e-5, rtol=0)


def test_rotate_by_zero_is_the_identity_and_keeps_dtype(rope):
    x = torch.randn(4, 2, HEAD_DIM, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    out = rope.rotate_by(x, torch.zeros(4, dtype=torch.long))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, x)
