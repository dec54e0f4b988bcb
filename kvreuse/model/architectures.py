"""The architectures kvreuse runs: for each, its model class, the names it goes by in Hugging Face configs and GGUF
files, its tensors' names there, and what its checkpoints store differently."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvreuse.model.decoder import CausalLM
from kvreuse.model.gemma3 import Gemma3
from kvreuse.model.llama import Llama
from kvreuse.model.phi3 import Phi3
from kvreuse.model.qwen import Qwen2, Qwen3

# A layer's tensors under our names, by their name inside the layer of an HF checkpoint ("model.layers.{i}.") ...
HF_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_attention_norm",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
# ... and of a GGUF ("blk.{i}.").
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "attn_output.weight": "o_proj",
    "ffn_norm.weight": "post_attention_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
}
_GEMMA_HF = {**HF_LAYER_NAMES, "pre_feedforward_layernorm.weight": "pre_feedforward_norm",
             "post_feedforward_layernorm.weight": "post_feedforward_norm"}
_GEMMA_GGUF = {**{k: v for k, v in GGUF_LAYER_NAMES.items() if k != "ffn_norm.weight"},
               "post_attention_norm.weight": "post_attention_norm", "ffn_norm.weight": "pre_feedforward_norm",
               "post_ffw_norm.weight": "post_feedforward_norm"}

# Phi-3 stores q/k/v stacked in one tensor and gate/up in another, as our fused linears are (decoder.fused_parts).
_PHI3_HF = {
    "input_layernorm.weight": "input_norm",
    "self_attn.qkv_proj.weight": "qkv_proj",
    "self_attn.o_proj.weight": "o_proj",
    "post_attention_layernorm.weight": "post_attention_norm",
    "mlp.gate_up_proj.weight": "gate_up_proj",
    "mlp.down_proj.weight": "down_proj",
}
_PHI3_GGUF = {
    "attn_norm.weight": "input_norm",
    "attn_qkv.weight": "qkv_proj",
    "attn_output.weight": "o_proj",
    "ffn_norm.weight": "post_attention_norm",
    "ffn_up.weight": "gate_up_proj",          # gate and up, 2 * intermediate rows, gate first
    "ffn_down.weight": "down_proj",
}


@dataclass(frozen=True)
class Architecture:
    name: str
    model_class: type[CausalLM]
    hf_model_types: tuple[str, ...]
    gguf_names: tuple[str, ...]          # `general.architecture` values
    hidden_act: str = "silu"             # the only activation its checkpoints may name
    qk_norm: bool = False
    gguf_permuted_qk: bool = False       # llama.cpp's converter interleaved each Q/K head's rotary halves
    hf_norm_offset: float = 0.0          # added to every norm weight of an HF checkpoint (Gemma stores w of 1 + w)
    hf_layer_names: dict[str, str] = field(default_factory=lambda: HF_LAYER_NAMES)
    gguf_layer_names: dict[str, str] = field(default_factory=lambda: GGUF_LAYER_NAMES)


ARCHITECTURES = {a.name: a for a in (
    Architecture("llama", Llama, ("llama", "mistral"), ("llama", "mistral"), gguf_permuted_qk=True),
    Architecture("qwen2", Qwen2, ("qwen2",), ("qwen2",)),
    Architecture("qwen3", Qwen3, ("qwen3",), ("qwen3",), qk_norm=True),
    Architecture("gemma3", Gemma3, ("gemma3_text",), ("gemma3",), hidden_act="gelu_pytorch_tanh", qk_norm=True,
                 hf_norm_offset=1.0, hf_layer_names=_GEMMA_HF, gguf_layer_names=_GEMMA_GGUF),
    Architecture("phi3", Phi3, ("phi3",), ("phi3",), hf_layer_names=_PHI3_HF, gguf_layer_names=_PHI3_GGUF),
)}
SUPPORTED = "llama, mistral, qwen2 (Qwen2/2.5), qwen3, gemma3_text (Gemma 3), phi3 (Phi-3)"


def by_hf_model_type(model_type: str | None) -> Architecture | None:
    return next((a for a in ARCHITECTURES.values() if model_type in a.hf_model_types), None)


def by_gguf_name(name: str | None) -> Architecture | None:
    return next((a for a in ARCHITECTURES.values() if name in a.gguf_names), None)
