"""Llama (Llama 2/3, SmolLM2, Mistral): RMSNorm, RoPE, GQA, SwiGLU; the shared decoder as it is."""

from __future__ import annotations

from kvreuse.model.decoder import FUSED_LINEARS, CausalLM, DecoderLayer, layer_caches

__all__ = ["FUSED_LINEARS", "Llama", "layer_caches"]


class Llama(CausalLM):
    layer_class = DecoderLayer
