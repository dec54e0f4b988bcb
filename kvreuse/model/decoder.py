"""The decoder-only transformer every supported architecture shares over the paged KV pool: embeddings, layers of
(norm, qkv, RoPE, paged attention, MLP), final norm, LM head. An architecture's module (llama.py, qwen.py,
gemma3.py) says what its layer adds (biases, q/k norms, norm placement, activation) by subclassing these."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn

from kvreuse.layers.attention import AttentionMetadata, paged_attention, store_and_attend, store_kv
from kvreuse.layers.norm import RMSNorm
from kvreuse.layers.pointwise import gated, rotary
from kvreuse.layers.rotary import RotaryEmbedding
from kvreuse.model.args import ModelArgs

# Each layer's fused linears and the loaded weights stacked (along the output rows) into each, unless the checkpoint
# stores the fused tensor itself (Phi-3's qkv_proj and gate_up_proj), loaded under the fused name: `fused_parts`.
FUSED_LINEARS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
FUSED_BIASES = {"qkv_bias": ("q_bias", "k_bias", "v_bias")}


def fused_parts(loaded: Collection[str], prefix: str, fused: str) -> list[str]:
    """The loaded tensors' names to stack, in order, into layer `prefix`'s ("layers.3.") fused linear `fused`: the
    checkpoint's own fused tensor where `loaded` has one, else the parts FUSED_LINEARS names."""
    if prefix + fused in loaded:
        return [prefix + fused]
    return [prefix + part for part in FUSED_LINEARS[fused]]


CosSin = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer kind -> (cos, sin), [T, 1, D] each


class Attend(Protocol):
    def __call__(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store one layer's new K/V ([T, Hkv, D] each) and attend with its rotated q [T, H, D] -> [T, H * D]."""
        ...


class DecoderLayer(nn.Module):
    """Pre-norm attention and a gated MLP (SwiGLU), with optional q/k/v biases and per-head q/k norms."""

    norm_class: ClassVar[type[nn.Module]] = RMSNorm
    activation: ClassVar[str] = "silu"  # the gate's: one of layers/pointwise.py's ACTIVATIONS

    def __init__(self, args: ModelArgs, layer_index: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.attention_scale
        self.kind = args.layer_kind(layer_index)     # "full" | "sliding": which rotary and window
        self.window = args.window(layer_index)
        norm = self.norm_class
        self.input_norm = norm(args.hidden_size, args.rms_norm_eps)
        # Q, K, V and gate, up are fused: one GEMM each instead of three and two. Biases are kept apart, so that
        # every linear stays bias-free (quantization and the GGUF kernel take them as they are).
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.qkv_bias = nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size)) if args.attention_bias else None
        self.q_norm = norm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = norm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.post_attention_norm = norm(args.hidden_size, args.rms_norm_eps)
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [T, hidden] -> rotated q [T, H, D], rotated k [T, Hkv, D], v [T, Hkv, D]."""
        qkv = self.qkv_proj(self.input_norm(x))                          # [T, (H + 2 Hkv) D]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotary(q, cos, sin), rotary(k, cos, sin), v.view(-1, self.num_kv_heads, self.head_dim)

    def mlp(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention; x: [T, hidden], attended: [T, H * D]."""
        x = x + self.o_proj(attended)
        return x + self.down_proj(gated(self.gate_up_proj(self.post_attention_norm(x)), self.activation))


def layer_caches(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[num_layers, 2, num_blocks, block_size, Hkv, D] -> each layer's (k_cache, v_cache) views, in four ops
    rather than three per layer."""
    k_caches, v_caches = kv_cache.unbind(1)                               # [num_layers, num_blocks, ...] each
    return list(zip(k_caches.unbind(0), v_caches.unbind(0), strict=True))


@dataclass
class ForwardKV:
    """Where each layer of one forward stores and reads its K/V: its (k_cache, v_cache) views of the pool and the
    attention metadata of its layer group (kvcache/layout.py; the layers of a group share one)."""
    caches: Sequence[tuple[torch.Tensor, torch.Tensor]]  # per model layer
    metas: Sequence[AttentionMetadata]                    # per model layer

    @classmethod
    def uniform(cls, kv_cache: torch.Tensor, meta: AttentionMetadata) -> ForwardKV:
        """A pool of one group, [num_layers, 2, num_blocks, block_size, Hkv, D]: layer i in slot i, one metadata."""
        caches = layer_caches(kv_cache)
        return cls(caches, [meta] * len(caches))


class CausalLM(nn.Module):
    """A decoder-only LM over the paged KV pool. Subclasses name their layer class and how a checkpoint's tensors
    (under our names, loader.py) become this module's state."""

    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer

    def __init__(self, args: ModelArgs, max_positions: int | None = None):
        """`max_positions`: the longest context served (the RoPE tables' length); None: the model's own."""
        super().__init__()
        self.args = args
        # Not initialized: the weights come from a checkpoint (from_weights), and normal_ on the meta device
        # imports dynamo (~1 s of a server's start, before its compile needs it).
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.layers = nn.ModuleList(self.layer_class(args, i) for i in range(args.num_layers))
        self.norm = self.layer_class.norm_class(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotaries = self._rotaries(min(args.max_position_embeddings, max_positions or args.max_position_embeddings))

    def _rotaries(self, positions: int) -> nn.ModuleDict:
        """One table per rotary, `positions` long: sized by the context served, not the file's context length (a
        table of 2^24 positions is gigabytes)."""
        args, kinds = self.args, sorted({layer.kind for layer in self.layers})
        return nn.ModuleDict({kind: RotaryEmbedding(args.head_dim, positions, args.rope_of(kind)) for kind in kinds})

    @classmethod
    def from_weights(cls, weights, dtype: torch.dtype, device: torch.device,
                     max_positions: int | None = None) -> CausalLM:
        """The model of `weights` (loader.LoadedWeights: tensors under our names) in `dtype` on `device`, serving
        contexts of up to `max_positions` tokens (None: the model's context length)."""
        with torch.device("meta"):
            model = cls(weights.args, max_positions)
        state = model.state_from(weights.tensors)
        fp32 = {name for name, module in model.named_modules() if getattr(module, "keeps_fp32", False)}
        state = {k: v.float() if k.rpartition(".")[0] in fp32 else v.to(dtype) for k, v in state.items()}
        model.load_state_dict(state, strict=False, assign=True)
        if model.args.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        missing = {name for name, p in model.named_parameters() if p.is_meta}
        if missing:
            raise ValueError(f"the checkpoint lacks {sorted(missing)[:4]}")
        return model.to(device).eval()

    def state_from(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This module's state from a checkpoint's tensors under our names (fp32), the fused ones concatenated."""
        state = {"embed_tokens.weight": tensors["embed_tokens"], "norm.weight": tensors["norm"]}
        if not self.args.tie_word_embeddings:
            state["lm_head.weight"] = tensors["lm_head"]
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            for name, module in layer.named_children():
                if isinstance(module, nn.Linear):
                    state[p + name + ".weight"] = torch.cat([tensors[k] for k in fused_parts(tensors, p, name)])
                elif not isinstance(module, nn.ModuleList) and hasattr(module, "weight"):
                    state[p + name + ".weight"] = tensors[p + name]
            if layer.qkv_bias is not None:
                state[p + "qkv_bias"] = torch.cat([tensors[p + part] for part in FUSED_BIASES["qkv_bias"]])
        return state

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> CosSin:
        """Every rotary's cos, sin [T, 1, D] at positions [T], computed once per forward."""
        return {kind: rotary.cos_sin(positions, dtype) for kind, rotary in self.rotaries.items()}

    def rotate_by(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Move already-rotated keys of every layer, keys [L, T, Hkv, D], by `deltas` [T] positions, each layer
        with its own rotary (segment reuse)."""
        moved = {kind: rotary.rotate_by(keys, deltas) for kind, rotary in self.rotaries.items()}
        if len(moved) == 1:
            return next(iter(moved.values()))
        return torch.stack([moved[layer.kind][i] for i, layer in enumerate(self.layers)])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]."""
        return self.embed_tokens(input_ids)

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
        x = self.embed(input_ids)                                         # [T, hidden]
        cos_sin = self.cos_sin(positions, x.dtype)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, layer_caches(kv_cache), strict=True)):
            if i != select_layer:
                q, k, v = layer.qkv(x, *cos_sin[layer.kind])
                x = layer.mlp(x, store_and_attend(q, k, v, k_cache, v_cache, meta, layer.scale, layer.window))
                continue
            q, k, v = layer.qkv(x, *cos_sin[layer.kind])
            kept = select(k, v, meta.slot_mapping)                        # [T'] kept rows, ascending
            store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            kept_index = torch.searchsorted(kept, rows).clamp_max(len(kept) - 1)  # [S] their new rows
            assert bool((kept[kept_index] == rows).all()), "a row that gives logits was not kept"
            meta, rows = meta_for(kept), kept_index
            x, q = x[kept], q[kept]
            cos_sin = {kind: (cos[kept], sin[kept]) for kind, (cos, sin) in cos_sin.items()}
            x = layer.mlp(x, paged_attention(q, k_cache, v_cache, meta, layer.scale, layer.window))
        return self.norm(x[rows])

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: ForwardKV,
                      rows: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; `kv` says where each layer's K/V go. The final (normed) hidden states [S, hidden]
        of `rows` [S], the rows of the batch to produce logits for (`compute_logits`)."""
        def attend(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            layer = self.layers[layer_index]
            return store_and_attend(q, k, v, *kv.caches[layer_index], kv.metas[layer_index], layer.scale,
                                    layer.window)

        return self.run_layers(input_ids, positions, rows, attend)

    def run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None,
                   attend: Attend) -> torch.Tensor:
        """Every layer over input_ids, positions [T], attention (and the K/V pool) left to `attend`; the final
        hidden states [S, hidden] of `rows` [S] (None: every row, S = T). The compiled step (decode_graph.py) runs
        this very code with its attention outside the graph."""
        x = self.embed(input_ids)                                         # [T, hidden]
        cos_sin = self.cos_sin(positions, x.dtype)                        # [T, 1, D] each
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, *cos_sin[layer.kind])
            x = layer.mlp(x, attend(i, q, k, v))
        return self.norm(x if rows is None else x[rows])                 # [S, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] final hidden states -> fp32 logits [S, vocab]."""
        logits = self.lm_head(hidden).float()
        cap = self.args.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
