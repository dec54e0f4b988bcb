"""Weight-only quantization (kvreuse/weights/quantize.py): each quantized linear multiplies by exactly the weight it
dequantizes to (the kernel up to its bf16 rounding, the dense path up to fp32 rounding), the quantization error stays
within half a step, and a quantized tiny model runs through the engine with logits close to the unquantized one's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams
from kvreuse.weights.quantize import (
    KERNEL_MAX_ROWS,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    quantization_tag,
    quantize_model,
    weight_bytes,
)

from .helpers import greedy, tiny_config, tiny_engine

# (out, in): the tiny model's shapes, an output count that needs int4's row padding, and SmolLM2's MLP down shape.
SHAPES = [(128, 64), (100, 64), (576, 1536)]


def random_weight(out: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, k, generator=g) * k ** -0.5


def make(mode: str, weight: torch.Tensor, group_size: int = 32, **kwargs) -> QuantizedLinear:
    return Int8Linear(weight, **kwargs) if mode == "int8" else Int4Linear(weight, group_size, **kwargs)


@pytest.mark.parametrize("mode,group_size", [("int8", None), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_quantized_linear_multiplies_by_its_dequantized_weight(mode, group_size, shape):
    layer = make(mode, random_weight(*shape), group_size or 32)
    weight = layer.dequantize(torch.float32)                             # [out, in]
    assert weight.shape == shape and layer.use_kernel                    # a CPU run: the kernel path is tested
    g = torch.Generator().manual_seed(1)
    for rows in (1, 7, KERNEL_MAX_ROWS[mode]):                           # the kernel: bf16 inputs, bf16 output
        x = torch.randn(rows, shape[1], generator=g)
        y = layer(x)
        assert y.dtype == torch.float32 and y.shape == (rows, shape[0])
        torch.testing.assert_close(y, x.bfloat16().float() @ weight.T, rtol=2 ** -8, atol=1e-5)
    x = torch.randn(KERNEL_MAX_ROWS[mode] + 1, shape[1], generator=g)   # dequantize + fp32 matmul
    torch.testing.assert_close(layer(x), x @ weight.T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_bf16_layer_keeps_bf16_and_the_leading_dims(mode):
    layer = make(mode, random_weight(128, 64).bfloat16())
    x = torch.randn(2, 3, 64).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 128)
    ref = x.float() @ layer.dequantize(torch.float32).T
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3)
    assert layer(torch.randn(0, 64).bfloat16()).shape == (0, 128)


def test_int8_error_is_at_most_half_a_step_per_output_channel():
    weight = random_weight(96, 128)
    layer = Int8Linear(weight)
    step = layer.scales.float()[:, None]                                 # [out, 1]
    assert (layer.dequantize(torch.float32) - weight).abs().le(step / 2 + 1e-7).all()
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() <= 127


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_error_is_at_most_half_a_step_per_group(group_size):
    weight = random_weight(96, 128)
    weight[0, :group_size], weight[1, :group_size], weight[2, :group_size] = 0.375, -0.125, 0.0  # constant groups
    layer = Int4Linear(weight, group_size)
    step = layer.scales_and_zeros[..., 0].float().t().repeat_interleave(group_size, dim=1)[:96]  # [out, in]
    # The zero is rounded to bf16, which can move the grid by a little more than rounding the weights would.
    dequantized = layer.dequantize(torch.float32)
    assert (dequantized - weight).abs().le(step * 0.51).all()
    assert torch.equal(dequantized[:3, :group_size], weight[:3, :group_size])
    assert int(layer.codes().max()) <= 15


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantizing_a_dequantized_weight_gives_it_back_exactly(mode):
    """Weights that are already on the scheme's grid (as the embedded model's Q4_1 linears are on int4's, group 32)
    come back unchanged."""
    once = make(mode, random_weight(128, 64)).dequantize(torch.float32)
    assert torch.equal(make(mode, once).dequantize(torch.float32), once)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_without_the_kernel_the_same_weight_is_dequantized_and_multiplied(mode):
    """What a non-CPU device runs (use_kernel=False): the same codes, stored in order for int4, always dense.
    For int4 this also checks that torch's machine-specific CPU packing is read back right."""
    weight = random_weight(100, 64)
    with_kernel, without = make(mode, weight), make(mode, weight, use_kernel=False)
    assert with_kernel.use_kernel and not without.use_kernel
    assert torch.equal(without.dequantize(torch.float32), with_kernel.dequantize(torch.float32))
    x = torch.randn(3, 64)
    torch.testing.assert_close(without(x), x @ without.dequantize(torch.float32).T, rtol=1e-5, atol=1e-6)


def test_int8_without_a_kernel_friendly_width_still_works():
    layer = Int8Linear(random_weight(32, 40))                           # 40 inputs: the kernel is not used
    assert not layer.use_kernel
    x = torch.randn(2, 40)
    torch.testing.assert_close(layer(x), x @ layer.dequantize(torch.float32).T, rtol=1e-5, atol=1e-6)


def test_quantization_tags():
    assert quantization_tag("none") == ""
    assert quantization_tag("int8") == "w8"
    assert quantization_tag("int4") == "w4g32"
    assert quantization_tag("int4", group_size=64) == "w4g64"
    assert quantization_tag("int4", lm_head="int4") == "w4g32.h4g32"
    assert quantization_tag("int8", lm_head="none") == "w8.hnone"
    assert quantization_tag("int4", lm_head="int8") == quantization_tag("int4")  # the default head: no suffix
    with pytest.raises(ValueError, match="unknown quantization mode"):
        quantization_tag("int3")


# --- the tiny model, through the engine ---------------------------------------------------------------------------
SHORT = "The capital of France is"                                     # prefill on the kernel path
LONG = "Paged attention stores keys and values in fixed-size blocks. " * 12  # > 64 tokens: the dense path


def first_logits(llm: LLM, prompts: list[str], max_tokens: int = 1):
    return llm.generate(prompts, SamplingParams(max_tokens=max_tokens, keep_first_logits=True, ignore_eos=True))


def test_none_leaves_the_model_untouched(tiny_llm):
    model = tiny_llm.engine.runner.model
    before = {name: (type(m), id(m)) for name, m in model.named_modules()}
    quantize_model(model, "none")
    assert {name: (type(m), id(m)) for name, m in model.named_modules()} == before


def test_every_decoder_linear_and_the_head_are_replaced_once(tiny_llm):
    model = tiny_llm.engine.runner.model
    embedding = model.embed_tokens.weight
    quantize_model(model, "int4")
    for layer in model.layers:
        assert all(isinstance(getattr(layer, n), Int4Linear)
                   for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert isinstance(model.lm_head, Int8Linear)                        # LM_HEAD["int4"]
    assert isinstance(model.embed_tokens, nn.Embedding) and model.embed_tokens.weight is embedding
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(model, "int8")


@pytest.mark.parametrize("mode,min_cosine", [("int8", 0.999), ("int4", 0.93)])
def test_quantized_logits_stay_close_to_the_unquantized(tiny_model_dir, tiny_llm, mode, min_cosine):
    """First-token logits, fp32. The tiny model's random Gaussian weights are the hard case for 4 bits (unlike the
    embedded model's linears, already Q4_1 on int4's grid): int8 gave cosine similarities of 0.9996-0.9998 on four
    prompts, int4 0.95-0.99 (group 32; group 64: 0.89-0.98)."""
    exact = first_logits(tiny_llm, [SHORT, LONG])
    quantized = LLM(tiny_config(tiny_model_dir))
    quantize_model(quantized.engine.runner.model, mode)
    approx = first_logits(quantized, [SHORT, LONG])
    for e, a in zip(exact, approx, strict=True):
        assert F.cosine_similarity(e.first_logits, a.first_logits, dim=0) > min_cosine


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_the_quantized_model_computes_with_its_dequantized_weights(tiny_model_dir, mode):
    """The same model with every quantized linear swapped for a plain linear holding its dequantized weight gives the
    same logits: to fp32 rounding with every product on the dense path, to bf16 rounding with the kernels (the LM
    head always runs on them: one row per sequence)."""
    quantized, reference = LLM(tiny_config(tiny_model_dir)), LLM(tiny_config(tiny_model_dir))
    quantize_model(quantized.engine.runner.model, mode)
    layers = [m for m in quantized.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    for module, ref_layer in zip(quantized.engine.runner.model.modules(), reference.engine.runner.model.modules(),
                                 strict=True):
        if isinstance(module, QuantizedLinear):
            ref_layer.weight = nn.Parameter(module.dequantize(torch.float32), requires_grad=False)
    expected = first_logits(reference, [SHORT, LONG])
    for e, a in zip(expected, first_logits(quantized, [SHORT, LONG]), strict=True):
        assert F.cosine_similarity(e.first_logits, a.first_logits, dim=0) > 0.9999
    for layer in layers:
        layer.kernel_max_rows = 0                                        # every product dense, in fp32
    for e, a in zip(expected, first_logits(quantized, [SHORT, LONG]), strict=True):
        torch.testing.assert_close(a.first_logits, e.first_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_engine_serves_a_batch_end_to_end(tiny_model_dir, mode, dtype):
    llm = LLM(tiny_config(tiny_model_dir, model__dtype=dtype))
    quantize_model(llm.engine.runner.model, mode)
    outputs = llm.generate([SHORT, LONG, "1, 2, 3,"], greedy(12))
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outputs)
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_kv_blocks


def test_weight_bytes_shrink_with_the_mode(tiny_model_dir):
    sizes = {}
    for mode in ("none", "int8", "int4"):
        llm = LLM(tiny_config(tiny_model_dir))
        quantize_model(llm.engine.runner.model, mode)
        sizes[mode] = weight_bytes(llm.engine.runner.model)
    linears = {mode: s["decoder_linears"] for mode, s in sizes.items()}
    # fp32 -> int8 + a bf16 scale per row of 64; -> int4 + a bf16 scale and zero per 32 weights (4 + 1 bits).
    assert linears["int8"] < linears["none"] / 3.8 and linears["int4"] < linears["none"] / 6
    assert sizes["int8"]["lm_head"] < sizes["none"]["lm_head"] / 3.8


def test_the_engine_quantizes_by_config_and_keys_its_blocks_apart(tiny_model_dir):
    from kvreuse.weights.quantize import Int8Linear

    plain = tiny_engine(tiny_model_dir, engine__num_kv_blocks=16)
    int8 = tiny_engine(tiny_model_dir, engine__num_kv_blocks=16, model__quantization="int8")
    assert isinstance(int8.runner.model.layers[0].qkv_proj, Int8Linear)
    assert int8.front_end.fingerprint == plain.front_end.fingerprint + ":w8" == int8.kv_manager.fingerprint
    tokens = list(range(40))
    assert int8.kv_manager.new_request(tokens).extra_key != plain.kv_manager.new_request(tokens).extra_key
