"""Gemma 3 (text): embeddings scaled by sqrt(hidden); `1 + w` RMSNorms in fp32, four per layer (around attention
and around the MLP); q/k norms; GeGLU with tanh GELU; attention scaled by query_pre_attn_scalar^-1/2; local
(sliding-window) and global layers with their own RoPE bases."""

from __future__ import annotations

import torch

from kvreuse.layers.norm import GemmaRMSNorm
from kvreuse.layers.pointwise import gated, scaled
from kvreuse.model.args import ModelArgs
from kvreuse.model.decoder import CausalLM, DecoderLayer


class Gemma3Layer(DecoderLayer):
    norm_class = GemmaRMSNorm
    activation = "gelu_tanh"

    def __init__(self, args: ModelArgs, layer_index: int):
        super().__init__(args, layer_index)
        self.pre_feedforward_norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_feedforward_norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    def mlp(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden], attended: [T, H * D]. Here `post_attention_norm` normalises the attention's output."""
        x = x + self.post_attention_norm(self.o_proj(attended))
        gated_up = gated(self.gate_up_proj(self.pre_feedforward_norm(x)), self.activation)     # [T, I]
        return x + self.post_feedforward_norm(self.down_proj(gated_up))


class Gemma3(CausalLM):
    layer_class = Gemma3Layer

    def __init__(self, args: ModelArgs, max_positions: int | None = None):
        super().__init__(args, max_positions)
        # sqrt(hidden) rounded to each model dtype, as the reference rounds it (on the CPU even in a meta context)
        self.embed_scales = {dtype: torch.tensor(args.hidden_size ** 0.5, device="cpu").to(dtype).item()
                             for dtype in (torch.float32, torch.bfloat16, torch.float16)}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden], scaled by sqrt(hidden) rounded to the model dtype, as the reference."""
        x = self.embed_tokens(input_ids)
        return scaled(x, self.embed_scales[x.dtype])
