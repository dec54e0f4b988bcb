"""GGUF files of each architecture, written in the test from a tiny HF model the way llama.cpp's converter writes
them (Q/K rows interleaved for llama only, Gemma's norms stored as 1 + w, Llama 3's scaling as `rope_freqs`, Phi-3's
fused qkv and gate/up as they are, with no key length), load to the HF directory's model: the same logits."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvreuse.model.architectures import ARCHITECTURES
from kvreuse.weights.errors import ModelLoadError
from kvreuse.weights.loader import load_weights

from .test_architectures import SHAPE, build, our_model_logits, prompts

GGUF_NAMES = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "phi3": "phi3"}
# What a Gemma 3 GGUF cannot say, llama.cpp assumes: every sixth layer global, local layers at base 10,000, attention
# scaled by head_dim^-1/2, no rope scaling. The tiny model follows that.
OVERRIDES = {"gemma3": dict(num_hidden_layers=6, layer_types=None, sliding_window_pattern=6,
                            query_pre_attn_scalar=SHAPE["head_dim"],
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})}
_HF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's interleaving of each head's two rotary halves (the inverse of the loader's _unpermute_rope)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(hf_dir: str, name: str, path, extra: Callable | None = None, layer_type=None) -> None:
    """The GGUF of `hf_dir` (an HF directory of MODELS[name]) at `path`; `extra(writer)` adds to it; the layers'
    matrices are stored as `layer_type` (a gguf.GGMLQuantizationType; None: F32)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from kvreuse.layers.rotary import inv_frequencies
    from kvreuse.weights.loader import _hf_args

    arch_name = GGUF_NAMES[name]
    arch = next(a for a in ARCHITECTURES.values() if arch_name in a.gguf_names)
    config = AutoConfig.from_pretrained(hf_dir)
    tensors = load_file(f"{hf_dir}/model.safetensors")
    args = _hf_args(arch, config, set(tensors), hf_dir)
    writer = gguf.GGUFWriter(str(path), arch_name)
    writer.add_context_length(args.max_position_embeddings)
    writer.add_embedding_length(args.hidden_size)
    writer.add_block_count(args.num_layers)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_heads)
    writer.add_head_count_kv(args.num_kv_heads)
    writer.add_rope_dimension_count(args.head_dim)
    if arch_name != "phi3":  # the converter writes none for Phi-3: a head is hidden / heads wide
        writer.add_key_length(args.head_dim)
        writer.add_value_length(args.head_dim)
    writer.add_rope_freq_base(args.rope.theta)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    if args.sliding_window:
        writer.add_sliding_window(args.sliding_window)
    if args.rope.kind == "llama3":  # the converter writes the scaling as per-frequency divisors
        base = inv_frequencies(args.head_dim, type(args.rope)(args.rope.theta))
        writer.add_tensor("rope_freqs.weight", (base / inv_frequencies(args.head_dim, args.rope)).float().numpy())
    hf_names = {theirs: ours for theirs, ours in arch.hf_layer_names.items()}
    gguf_names = {ours: theirs for theirs, ours in arch.gguf_layer_names.items()}
    for hf_name, tensor in tensors.items():
        data = tensor.float().numpy()
        if hf_name in _HF_TOP:
            gguf_name = _HF_TOP[hf_name]
        else:
            layer, _, inside = hf_name.removeprefix("model.layers.").partition(".")
            gguf_name = f"blk.{layer}.{gguf_names[hf_names[inside]]}"
            if arch.gguf_permuted_qk and inside in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                data = permute(data, args.num_heads if "q_proj" in inside else args.num_kv_heads)
        if arch.hf_norm_offset and hf_name.endswith("norm.weight"):
            data = data + arch.hf_norm_offset
        if layer_type is not None and gguf_name.startswith("blk.") and data.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, layer_type), raw_dtype=layer_type)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", list(GGUF_NAMES))
def test_a_gguf_of_each_architecture_loads_to_the_hf_directorys_model(name, tmp_path, real_tokenizer):
    hf_dir = str(build(name, tmp_path / "hf", len(real_tokenizer.hf), real_tokenizer, **OVERRIDES.get(name, {})))
    write_gguf(hf_dir, name, tmp_path / "model.gguf")
    from_hf, from_gguf = load_weights(hf_dir), load_weights(tmp_path / "model.gguf")
    for field in ("architecture", "layer_kinds", "sliding_window", "attention_bias", "qk_norm", "tie_word_embeddings"):
        assert getattr(from_gguf.args, field) == getattr(from_hf.args, field), field
    for ids in prompts()[1:3]:
        torch.testing.assert_close(our_model_logits(from_gguf, ids), our_model_logits(from_hf, ids),
                                   atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("extra, refusal", [
    (lambda w: w.add_tensor("rope_factors_long.weight", np.ones(8, np.float32)),
     r"rope type 'longrope' is not supported \(supported: default, linear, llama3\)"),
    (lambda w: w.add_rope_dimension_count(12),
     r"partial rotary \(phi3.rope.dimension_count = 12 of a head's 16\) is not supported"),
], ids=["longrope", "partial-rotary"])
def test_a_phi3_gguf_variant_we_do_not_run_is_refused_by_name(extra, refusal, tmp_path, real_tokenizer):
    """Phi-3 128k's and Phi-3.5's LongRoPE (the converter writes its factors as tensors), and a partial rotary."""
    hf_dir = str(build("phi3", tmp_path / "hf", len(real_tokenizer.hf), real_tokenizer))
    write_gguf(hf_dir, "phi3", tmp_path / "model.gguf", extra)
    with pytest.raises(ModelLoadError, match=refusal):
        load_weights(tmp_path / "model.gguf")


def test_phi3s_fused_tensors_keep_their_blocks_for_the_gguf_kernel(tmp_path, real_tokenizer):
    """A checkpoint's own fused qkv and gate/up blocks are the fused linears' blocks, as stacked parts are."""
    import gguf

    from kvreuse.weights.gguf_weights import fused_blocks

    hf_dir = str(build("phi3", tmp_path / "hf", len(real_tokenizer.hf), real_tokenizer))
    write_gguf(hf_dir, "phi3", tmp_path / "model.gguf", layer_type=gguf.GGMLQuantizationType.Q8_0)
    weights = load_weights(tmp_path / "model.gguf", keep_blocks=True)
    blocks = fused_blocks(weights)
    for i in range(weights.args.num_layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            key = f"layers.{i}.{name}"
            assert blocks[key].source == "Q8_0"
            torch.testing.assert_close(blocks[key].dequantize(), weights.tensors[key], atol=0, rtol=0)
    assert blocks["layers.0.qkv_proj"].shape == (4 * 16 + 2 * 2 * 16, SHAPE["hidden_size"])
    assert blocks["layers.0.gate_up_proj"].shape == (2 * SHAPE["intermediate_size"], SHAPE["hidden_size"])


def test_a_tensor_type_the_reader_cannot_dequantize_is_refused_by_name(tmp_path, real_tokenizer, monkeypatch):
    """A type gguf-py cannot dequantize (a newer one than the installed reader knows) is refused, naming the tensor
    and its type. gguf-py reads every type it can write, so the reader's refusal is the one fault faked here."""
    import gguf.quants

    hf_dir = str(build("qwen2", tmp_path / "hf", len(real_tokenizer.hf), real_tokenizer))
    write_gguf(hf_dir, "qwen2", tmp_path / "model.gguf")
    real = gguf.quants.dequantize

    def dequantize(data, qtype):
        if qtype == gguf.GGMLQuantizationType.F32 and data.ndim == 2:
            raise NotImplementedError(f"Dequantization for {qtype.name} is not yet implemented")
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", dequantize)
    with pytest.raises(ModelLoadError, match=r"tensor \S+ has type F32, which the GGUF reader cannot dequantize"):
        load_weights(tmp_path / "model.gguf")
