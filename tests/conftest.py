"""Shared fixtures: the real embedded model (loaded once) and a tiny random-weight Llama in HF format."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kvreuse.config import Config, load_config
from kvreuse.llm import LLM
from kvreuse.model.loader import embedded_model_path, file_sha256
from kvreuse.model.tokenizer import Tokenizer

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096}


def make_config(**overrides) -> Config:
    """Config with `section.key=value` overrides written as section__key=value keyword arguments."""
    return load_config(None, [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()])


@pytest.fixture(scope="session")
def real_tokenizer() -> Tokenizer:
    path = embedded_model_path()
    return Tokenizer.load(path, file_sha256([path]))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, real_tokenizer) -> str:
    """A 2-layer Llama with random weights and the real SmolLM2 tokenizer, saved as an HF directory."""
    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = len(real_tokenizer.hf)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, **TINY}
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    h, i, d = TINY["hidden_size"], TINY["intermediate_size"], TINY["head_dim"]
    q, kv = TINY["num_attention_heads"] * d, TINY["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h), "model.norm.weight": (h,)}
    for layer in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    tensors = {name: (1.0 + 0.1 * torch.randn(shape, generator=g)) if len(shape) == 1
               else torch.randn(shape, generator=g) * shape[1] ** -0.5 for name, shape in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"))
    real_tokenizer.hf.save_pretrained(str(path))
    return str(path)


@pytest.fixture
def tiny_llm(tiny_model_dir) -> LLM:
    return LLM(make_config(model__path=tiny_model_dir, model__dtype="fp32", engine__num_kv_blocks=256))


@pytest.fixture(scope="session")
def real_llm() -> LLM:
    """The embedded SmolLM2-135M in fp32, shared by the tests that only read from it."""
    return LLM(make_config(model__dtype="fp32", engine__num_kv_blocks=512))
