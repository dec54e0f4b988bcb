"""Llama (Llama 2/3, SmolLM2, Mistral): RMSNorm, RoPE, GQA, SwiGLU; the shared decoder as it is."""

from __future__ import annotations

from kvreuse.model.decoder import CausalLM, DecoderLayer


class Llama(CausalLM):
    layer_class = DecoderLayer
