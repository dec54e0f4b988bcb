"""The Llama decoder family (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings) over a paged KV pool."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.layers.attention import AttentionMetadata, paged_attention, store_and_attend, store_kv
from kvreuse.layers.rotary import RotaryEmbedding, apply_rotary
from kvreuse.model.loader import LoadedWeights, ModelArgs

# Each layer's fused linears and the loaded weights stacked (along the output rows) into each.
FUSED_LINEARS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, dim]. Normalised in fp32 whatever the model dtype, as the reference implementation does."""
        if x.dtype == torch.float32:
            # One call instead of seven Python-level ops (torch still runs them as kernels inside), and the
            # same numbers (tests/test_decode_fastpath.py).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Lower precision: the reference rounds the normalised x to the model dtype before scaling by the weight.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Attend(Protocol):
    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store one layer's new K/V ([T, Hkv, D] each) and attend with its rotated q [T, H, D] -> [T, H * D]."""
        ...


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim ** -0.5
        self.input_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # Q, K, V and gate, up are fused: one GEMM each instead of three and two.
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.post_attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [T, hidden] -> rotated q [T, H, D], rotated k [T, Hkv, D], v [T, Hkv, D]."""
        q, k, v = self.qkv_proj(self.input_norm(x)).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        return self.mlp(x, store_and_attend(q, k, v, k_cache, v_cache, meta, self.scale))

    def mlp(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention; x: [T, hidden], attended: [T, H * D]."""
        x = x + self.o_proj(attended)
        gate, up = self.gate_up_proj(self.post_attention_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


def layer_caches(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[num_layers, 2, num_blocks, block_size, Hkv, D] -> each layer's (k_cache, v_cache) views, in four ops
    rather than three per layer."""
    k_caches, v_caches = kv_cache.unbind(1)                               # [num_layers, num_blocks, ...] each
    return list(zip(k_caches.unbind(0), v_caches.unbind(0), strict=True))


class Llama(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(args.head_dim, args.max_position_embeddings, args.rope_theta)

    @classmethod
    def from_weights(cls, weights: LoadedWeights, dtype: torch.dtype, device: torch.device) -> Llama:
        with torch.device("meta"):
            model = cls(weights.args)
        t = weights.tensors
        state = {"embed_tokens.weight": t["embed_tokens"], "norm.weight": t["norm"]}
        if not weights.args.tie_word_embeddings:
            state["lm_head.weight"] = t["lm_head"]
        for i in range(weights.args.num_layers):
            p = f"layers.{i}."
            state[p + "input_norm.weight"] = t[p + "input_norm"]
            state[p + "post_attention_norm.weight"] = t[p + "post_attention_norm"]
            for fused, parts in FUSED_LINEARS.items():
                state[p + fused + ".weight"] = torch.cat([t[p + part] for part in parts])
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
        if weights.args.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.rotary = RotaryEmbedding(weights.args.head_dim, weights.args.max_position_embeddings,
                                       weights.args.rope_theta)
        return model.to(device).eval()

    def forward_selective(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                          kv_cache: torch.Tensor, rows: torch.Tensor, select_layer: int,
                          select: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                          meta_for: Callable[[torch.Tensor], AttentionMetadata]) -> torch.Tensor:
        """Selective recomputation (CacheBlend) for a batch whose pool already holds reused K/V.

        Layers below `select_layer` run every row. At `select_layer`, K/V are computed for every row, then
        `select(fresh_k [T, Hkv, D], fresh_v [T, Hkv, D], slot_mapping [T])` (called before the pool is
        overwritten, so it can compare against the reused K/V) returns the rows to keep, ascending; from there
        on only those rows are computed (with attention metadata `meta_for(rows)`), and the other rows' K/V
        stay as reused.
        `rows` [S] names rows of the full batch, which must be kept. Returns their final hidden states [S, hidden]
        (`compute_logits` turns them into logits)."""
        x = self.embed_tokens(input_ids)                                  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)                # [T, 1, D] each
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, layer_caches(kv_cache), strict=True)):
            if i != select_layer:
                x = layer(x, cos, sin, k_cache, v_cache, meta)
                continue
            q, k, v = layer.qkv(x, cos, sin)
            kept = select(k, v, meta.slot_mapping)                        # [T'] kept rows, ascending
            store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            kept_index = torch.searchsorted(kept, rows).clamp_max(len(kept) - 1)  # [S] their new rows
            assert bool((kept[kept_index] == rows).all()), "a row that gives logits was not kept"
            meta, rows = meta_for(kept), kept_index
            x, q, cos, sin = x[kept], q[kept], cos[kept], sin[kept]
            x = layer.mlp(x, paged_attention(q, k_cache, v_cache, meta, layer.scale))
        return self.norm(x[rows])

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      kv_cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [num_layers, 2, num_blocks, block_size, Hkv, D]. The final (normed)
        hidden states [S, hidden] of `rows` [S], the rows of the batch to produce logits for (`compute_logits`)."""
        caches = layer_caches(kv_cache)

        def attend(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return store_and_attend(q, k, v, *caches[layer_index], meta, self.layers[layer_index].scale)

        return self.run_layers(input_ids, positions, rows, attend)

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None,
                   attend: Attend) -> torch.Tensor:
        """Every layer over input_ids, positions [T], attention (and the K/V pool) left to `attend`; the final
        hidden states [S, hidden] of `rows` [S] (None: every row, S = T). The compiled step (decode_graph.py) runs
        this very code with its attention outside the graph."""
        x = self.embed_tokens(input_ids)                                  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)                # [T, 1, D] each
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, cos, sin)
            x = layer.mlp(x, attend(i, q, k, v))
        return self.norm(x if rows is None else x[rows])                 # [S, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] final hidden states -> fp32 logits [S, vocab]."""
        return self.lm_head(hidden).float()
