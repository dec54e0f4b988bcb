"""A model's shape and the settings its architecture reads, independent of the file it came from."""

from __future__ import annotations

from dataclasses import dataclass

from kvreuse.layers.rotary import Rope

LAYER_KINDS = ("full", "sliding")


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: Rope                            # of the full-attention layers
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    architecture: str = "llama"           # a key of architectures.ARCHITECTURES
    attention_bias: bool = False          # Qwen2: q, k and v have biases
    qk_norm: bool = False                 # Qwen3, Gemma 3: per-head RMSNorm on q and k before RoPE
    layer_kinds: tuple[str, ...] = ()     # "full" | "sliding" per layer; () is every layer full
    sliding_window: int | None = None     # keys a sliding layer's query sees, itself included
    sliding_rope: Rope | None = None      # of the sliding layers, where it differs from `rope` (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scaled by its -1/2 power (default: head_dim)
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        if self.layer_kinds and len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"{len(self.layer_kinds)} layer kinds for {self.num_layers} layers")
        if unknown := set(self.layer_kinds) - set(LAYER_KINDS):
            raise ValueError(f"layer kind(s) {sorted(unknown)} are not supported (supported: {LAYER_KINDS})")
        if "sliding" in self.layer_kinds and not self.sliding_window:
            raise ValueError("sliding layers without a sliding_window")

    def layer_kind(self, layer_index: int) -> str:
        return self.layer_kinds[layer_index] if self.layer_kinds else "full"

    def window(self, layer_index: int) -> int | None:
        """The sliding window of a layer, None for full attention."""
        return self.sliding_window if self.layer_kind(layer_index) == "sliding" else None

    def rope_of(self, kind: str) -> Rope:
        return self.sliding_rope or self.rope if kind == "sliding" else self.rope

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5
