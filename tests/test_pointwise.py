"""The norms, RoPE and gated activations as kvreuse's ops (layers/pointwise.py, kernels/pointwise.cpp): the kernels
against the torch ops they replace, a row's bits whatever rows share the call, and bad input refused."""

from __future__ import annotations

import pytest
import torch

from kvreuse.kernels import build as kernels
from kvreuse.layers import pointwise
from kvreuse.layers.rotary import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(not kernels.load().loaded, reason=f"kernels not loaded: {kernels.load().reason}")

DTYPES = (torch.float32, torch.bfloat16)


def within_one_step(kernel: torch.Tensor, reference: torch.Tensor) -> None:
    """kernel and reference agree to their dtype's last bit (one rounding apart) at every value."""
    assert kernel.dtype == reference.dtype and kernel.shape == reference.shape
    step = torch.finfo(reference.dtype).eps
    tolerance = reference.float().abs() * step * (1.0 if reference.dtype == torch.bfloat16 else 8.0) + 1e-30
    assert bool(((kernel.float() - reference.float()).abs() <= tolerance).all()), \
        f"max diff {float((kernel.float() - reference.float()).abs().max())}"


def activations(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("round_first", [True, False])
@pytest.mark.parametrize("dim", [576, 640, 100])
def test_rms_norm_is_the_torch_norm_to_the_last_bit(dtype, round_first, dim):
    x = activations((37, dim), dtype)
    weight = activations((dim,), dtype if round_first else torch.float32, seed=1)
    kernel = pointwise.rms_norm(x, weight, 1e-6, round_first)
    reference = pointwise.rms_norm_in_torch(x, weight, 1e-6, round_first)
    within_one_step(kernel, reference)
    if dtype == torch.bfloat16:  # a row's scale may differ in its last fp32 bit, which bf16 rounding mostly absorbs
        assert float((kernel != reference).float().mean()) < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_takes_the_heads_of_a_fused_projection_as_they_lie(dtype):
    """Gemma's and Qwen3's q/k norms run over a view of the qkv rows [T, H, D], not contiguous."""
    qkv = activations((5, 3 * 4 * 64), dtype)
    q = qkv[:, :4 * 64].view(5, 4, 64)                                   # [T, H, D], row stride 768
    weight = activations((64,), torch.float32, seed=2)
    kernel = pointwise.rms_norm(q, weight, 1e-6, round_first=False)
    assert kernel.is_contiguous()
    torch.testing.assert_close(kernel, pointwise.rms_norm(q.contiguous(), weight, 1e-6, round_first=False),
                               rtol=0, atol=0)
    within_one_step(kernel, pointwise.rms_norm_in_torch(q, weight, 1e-6, round_first=False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_the_torch_rotation(dtype):
    rope = RotaryEmbedding(64, 4096, 10000.0)
    positions = torch.tensor([0, 1, 17, 1000, 4095])
    cos, sin = rope.cos_sin(positions, dtype)                             # [T, 1, D]
    qkv = activations((5, 3 * 64 * 3), dtype)
    x = qkv[:, :3 * 64].view(5, 3, 64)                                    # [T, H, D], not contiguous
    kernel = pointwise.rotary(x, cos, sin)
    reference = apply_rotary(x, cos, sin)
    if dtype == torch.bfloat16:  # every product exact in fp32, each rounded where torch rounds it: torch's bits
        assert torch.equal(kernel, reference)
    else:  # a product may be fused into the sum (FMA): a last bit of the products' magnitude
        torch.testing.assert_close(kernel, reference, rtol=0, atol=2 * torch.finfo(dtype).eps * float(x.abs().max()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", sorted(pointwise.ACTIVATIONS))
def test_gated_activations_are_the_torch_ones_to_the_last_bit(dtype, activation):
    gate_up = activations((33, 2 * 1536), dtype)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 90.0, -90.0, 1e4, -1e4]).to(dtype)  # exp's range's ends
    kernel = pointwise.gated(gate_up, activation)
    reference = pointwise.gated_in_torch(gate_up, activation)
    assert kernel.shape == (33, 1536)
    # act(gate) may differ in its last bit (its own exp; torch's tanh GELU adds 1 + tanh, a last fp32 bit of |gate|
    # where they cancel), and the product after it: a step of the dtype, and one of fp32 at |gate * up|.
    gate, up = gate_up.float().chunk(2, dim=-1)
    fp32_step = torch.finfo(torch.float32).eps
    tolerance = reference.float().abs() * torch.finfo(dtype).eps + (gate * up).abs() * 4 * fp32_step
    diff = (kernel.float() - reference.float()).abs()
    assert bool((diff <= tolerance).all()), f"max diff {float(diff.max())}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_is_the_torch_product(dtype):
    x = activations((7, 640), dtype)
    scale = float(torch.tensor(640 ** 0.5).to(dtype))
    assert torch.equal(pointwise.scaled(x, scale), x * scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_its_bits_whatever_rows_share_the_call(dtype):
    """A decode row alone, in a batch of 64, or inside a 300-row prompt: one result (the compiled step's buckets and
    the prompt's chunks hand each op different row counts)."""
    x = activations((300, 576), dtype)
    weight = activations((576,), dtype, seed=3)
    gate_up = activations((300, 2 * 1536), dtype, seed=4)
    heads = activations((300, 9, 64), dtype, seed=5)
    cos, sin = RotaryEmbedding(64, 512, 10000.0).cos_sin(torch.arange(300), dtype)
    for rows in (slice(7, 8), slice(0, 64), slice(0, 300)):
        k = range(rows.start, rows.stop).index(7)
        assert torch.equal(pointwise.rms_norm(x[rows], weight, 1e-5, True)[k], pointwise.rms_norm(x, weight, 1e-5,
                                                                                                    True)[7])
        assert torch.equal(pointwise.gated(gate_up[rows], "silu")[k], pointwise.gated(gate_up, "silu")[7])
        assert torch.equal(pointwise.rotary(heads[rows], cos[rows], sin[rows])[k], pointwise.rotary(heads, cos, sin)[7])


def test_bad_input_is_refused_with_what_is_wrong():
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="weight must be \\[D\\]"):
        torch.ops.kvreuse_cpu.rms_norm(x, torch.ones(32), 1e-6, True)
    with pytest.raises(RuntimeError, match="x must be fp32 or bf16"):
        torch.ops.kvreuse_cpu.rms_norm(x.half(), torch.ones(64), 1e-6, True)
    with pytest.raises(RuntimeError, match="activation must be 0 \\(silu\\) or 1 \\(gelu_tanh\\), not 7"):
        torch.ops.kvreuse_cpu.gated(x, 7)
    with pytest.raises(RuntimeError, match="cos and sin must be"):
        torch.ops.kvreuse_cpu.rotary(x.view(4, 1, 64), torch.ones(4, 1, 32), torch.ones(4, 1, 32))
