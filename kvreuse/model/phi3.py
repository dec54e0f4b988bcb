"""Phi-3 (the 4k-context mini and medium; Phi-4, which shares its model_type): the shared decoder as it is, with a
sliding window on every layer where `sliding_window` is set. Its checkpoints store q/k/v and gate/up already fused,
in our order (architectures.py names them so)."""

from __future__ import annotations

from kvreuse.model.decoder import CausalLM


class Phi3(CausalLM):
    pass
