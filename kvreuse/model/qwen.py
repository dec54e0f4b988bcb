"""Qwen2 / Qwen2.5 (biases on q, k and v) and Qwen3 (per-head RMSNorm on q and k before RoPE): the shared decoder
with those switched on by their ModelArgs (`attention_bias`, `qk_norm`)."""

from __future__ import annotations

from kvreuse.model.decoder import CausalLM


class Qwen2(CausalLM):
    pass


class Qwen3(CausalLM):
    pass
