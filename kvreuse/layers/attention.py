"""Paged attention in pure torch: K/V live in a block pool and are addressed through slots.

A slot is `block_id * block_size + offset`. Each forward writes the new tokens' K/V at their
`slot_mapping`, then every sequence attends to the slots of its whole context, gathered through
its block table. Sequences are padded to one [num_seqs, max_query_len] x [num_seqs, max_context_len]
problem so one SDPA call serves the batch; padding is masked out and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvreuse.kernels import build as kernels
from kvreuse.layers.kv_format import KVFormat, format_of
from kvreuse.layers.row_attention import attend_rows, kernels_read

# The KV pool's null block (kvreuse/kvcache/block.py's NULL_BLOCK; tests/test_attention.py keeps them equal): no
# request holds it, so it pads ragged block tables and stands where a sliding window has passed a block. Whatever it
# holds is masked.
NULL_BLOCK = 0
NULL_SLOT = 0  # its first slot (NULL_BLOCK * block_size at any block size): pads each sequence's keys


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [num_tokens] pool slot where each new token's K/V is written
    query_index: torch.Tensor    # [num_seqs, max_query_len] row of each query in the flat batch (pad: repeat)
    context_slots: torch.Tensor  # [num_seqs, max_context_len] pool slots of each sequence's keys (pad: NULL_SLOT)
    # [num_seqs, 1, max_query_len, max_context_len] True where attending is allowed; None when nothing is masked
    attn_mask: torch.Tensor | None
    output_index: torch.Tensor   # [num_tokens] rows of the padded output that are real tokens, in batch order
    causal: bool = False         # one sequence from position 0: plain causal attention, the mask is not needed
    decode: bool = False         # one query per sequence, at its last position: nothing to pad or drop
    context_lens: torch.Tensor | None = None  # [num_seqs] keys of each sequence (decode only: the fused kernel's)
    query_positions: torch.Tensor | None = None  # [num_seqs, max_query_len] position of each query (pad: repeat)
    # A long prompt's sliding-window attention, query rows [start, end) at a time over the keys they can see
    chunks: list[tuple[int, int, AttentionMetadata]] | None = None
    _windowed: dict[int, AttentionMetadata] = field(default_factory=dict, repr=False)
    _rows: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def build(
        cls,
        start_positions: list[int],
        query_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Sequence b computes positions [start_positions[b], start_positions[b] + query_lens[b]) and
        attends causally to every position before and including each query. A table entry NULL_BLOCK (a block its
        sliding window no longer reads) is read under the window's mask."""
        if all(n == 1 for n in query_lens):
            return cls.for_decode([s + 1 for s in start_positions], block_tables, block_size, device)
        queries = [torch.arange(s, s + n) for s, n in zip(start_positions, query_lens, strict=True)]
        meta = cls.for_queries(queries, block_tables, block_size, device)
        # SDPA's own causal path skips the masked upper triangle: about 2x faster on long prefills.
        meta.causal = len(queries) == 1 and start_positions[0] == 0
        return meta

    @classmethod
    def for_decode(cls, context_lens: list[int], block_tables: list[list[int]], block_size: int,
                   device: torch.device) -> AttentionMetadata:
        """Sequence b computes one token, at position context_lens[b] - 1, and attends to all its context.
        The same metadata `for_queries` builds for that case, with fewer ops (it is built every decode step)."""
        num_seqs, max_context_len = len(context_lens), max(context_lens)
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [NULL_BLOCK] * (max_blocks - len(t)) for t in block_tables])  # [B, blocks]
        lens = torch.tensor(context_lens)                                              # [B]
        key_pos = torch.arange(max_context_len)                                        # [K]
        context_slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size  # [B, K]
        rows = torch.arange(num_seqs)                                                  # [B]
        slot_mapping = context_slots[rows, lens - 1]                                   # [B]
        attn_mask = None
        if min(context_lens) < max_context_len:
            visible = key_pos < lens[:, None]                                          # [B, K]
            context_slots = torch.where(visible, context_slots, NULL_SLOT)
            attn_mask = visible[:, None, None, :].to(device)                           # [B, 1, 1, K]
        return cls(
            slot_mapping=slot_mapping.to(device),
            query_index=rows[:, None].to(device),
            context_slots=context_slots.to(device),
            attn_mask=attn_mask,
            output_index=rows.to(device),
            decode=True,
            context_lens=lens.to(device),
            query_positions=(lens - 1)[:, None].to(device),
        )

    @classmethod
    def for_queries(
        cls,
        query_positions: list[torch.Tensor],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Sequence b computes the ascending positions query_positions[b] (any subset, as selective
        recomputation keeps) and each attends to every pool slot at or before its position."""
        num_seqs = len(query_positions)
        q_lens = torch.tensor([len(p) for p in query_positions], dtype=torch.long)    # [B]
        max_query_len = int(q_lens.max())
        # Padded query rows repeat the last real query and sit at the sequence's first query position, so
        # each keeps >= 1 visible key (no NaN rows); their output is dropped.
        query_pos = torch.stack([F.pad(p, (0, max_query_len - len(p)), value=int(p[0]))
                                 for p in query_positions])                            # [B, Q]
        context_lens = torch.stack([p[-1] + 1 for p in query_positions])               # [B]
        max_context_len = int(context_lens.max())
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.full((num_seqs, max_blocks), NULL_BLOCK, dtype=torch.long)       # [B, blocks]
        for b, table in enumerate(block_tables):
            tables[b, : len(table)] = torch.tensor(table, dtype=torch.long)

        key_pos = torch.arange(max_context_len)                                        # [K]
        key_blocks = tables[:, torch.div(key_pos, block_size, rounding_mode="floor")]  # [B, K]
        context_slots = key_blocks * block_size + key_pos % block_size                 # [B, K]
        context_slots = torch.where(key_pos < context_lens[:, None], context_slots, NULL_SLOT)
        attn_mask = key_pos[None, None, :] <= query_pos[:, :, None]                    # [B, Q, K]

        j = torch.arange(max_query_len)                                                # [Q]
        valid_query = j < q_lens[:, None]                                              # [B, Q]
        cu_query = torch.cumsum(q_lens, 0) - q_lens                                    # [B]
        query_index = cu_query[:, None] + torch.minimum(j, q_lens[:, None] - 1)        # [B, Q]
        output_index = torch.arange(num_seqs * max_query_len).view(num_seqs, max_query_len)[valid_query]
        slot_mapping = torch.cat([context_slots[b, p] for b, p in enumerate(query_positions)])
        return cls(
            slot_mapping=slot_mapping.to(device),
            query_index=query_index.to(device),
            context_slots=context_slots.to(device),
            attn_mask=attn_mask.unsqueeze(1).to(device),
            output_index=output_index.to(device),
            query_positions=query_pos.to(device),
        )

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence and the position of each query row, in batch order: ([T], [T]). Built once per forward."""
        if self._rows is None:
            num_queries = self.query_index.shape[1]
            self._rows = (torch.div(self.output_index, num_queries, rounding_mode="floor"),
                          self.query_positions.flatten()[self.output_index])
        return self._rows

    def windowed(self, window: int | None) -> AttentionMetadata:
        """This forward's metadata for a sliding-window layer: each query sees the keys at positions
        (p - window, p], itself included. A decode keeps only each sequence's last `window` keys (the fused kernel
        then reads no more); queries of a prompt are masked, and one sequence's long prompt is cut into chunks of
        `window` queries, each over the keys it can see. Built once per window and forward."""
        if window is None or self.context_slots.shape[1] <= window:
            return self
        if window not in self._windowed:
            self._windowed[window] = self._decode_window(window) if self.decode else self._query_window(window)
        return self._windowed[window]

    def _decode_window(self, window: int) -> AttentionMetadata:
        lens = self.context_lens                                                       # [B]
        j = torch.arange(window, device=lens.device)                                   # [W]
        first = (lens - window).clamp_min(0)                                           # [B] first visible key
        new_lens = lens.clamp_max(window)                                              # [B]
        visible = j < new_lens[:, None]                                                # [B, W]
        keys = (first[:, None] + j).clamp_max(self.context_slots.shape[1] - 1)         # [B, W]
        slots = torch.where(visible, self.context_slots.gather(1, keys), NULL_SLOT)    # [B, W]
        mask = None if bool(visible.all()) else visible[:, None, None, :]              # [B, 1, 1, W]
        return AttentionMetadata(self.slot_mapping, self.query_index, slots, mask, self.output_index, decode=True,
                                 context_lens=new_lens, query_positions=self.query_positions)

    def _query_window(self, window: int, first_key: int = 0) -> AttentionMetadata:
        """`context_slots` hold the keys from position `first_key` on."""
        key_pos = first_key + torch.arange(self.context_slots.shape[1], device=self.context_slots.device)  # [K]
        query_pos = self.query_positions[:, :, None]                                   # [B, Q, 1]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - window)                 # [B, Q, K]
        meta = AttentionMetadata(self.slot_mapping, self.query_index, self.context_slots, mask.unsqueeze(1),
                                 self.output_index, query_positions=self.query_positions)
        num_seqs, num_queries = self.query_index.shape
        if num_seqs == 1 and self.context_slots.shape[1] > 2 * window:  # a chunk's keys never are
            meta.chunks = [(start, min(start + window, num_queries), self._query_chunk(start, window))
                           for start in range(0, num_queries, window)]
        return meta

    def _query_chunk(self, start: int, window: int) -> AttentionMetadata:
        """Query rows [start, start + window) of one sequence, over the keys they can see."""
        positions = self.query_positions[:, start:start + window]                      # [1, C] ascending
        first_key = max(0, int(positions[0, 0]) - window + 1)
        rows = torch.arange(positions.shape[1], device=positions.device)               # [C]
        slots = self.context_slots[:, first_key:int(positions[0, -1]) + 1]             # [1, K'] the keys it sees
        chunk = AttentionMetadata(self.slot_mapping, rows[None], slots, None, rows, query_positions=positions)
        return chunk._query_window(window, first_key)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache/v_cache: [num_blocks, block_size, num_kv_heads, W] in their format (kv_format.py; W = head_dim in a
    plain one); k/v: [T, num_kv_heads, head_dim]."""
    kv_format = format_of(k_cache)
    store_rows(k_cache, v_cache, kv_format.to_basis(k), kv_format.to_basis(v), slot_mapping)


def store_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
    """`store_kv` of K/V already in the pool's basis."""
    kv_format = format_of(k_cache)
    rows = k_cache.shape[-2:]                                                          # [Hkv, W]
    k_cache.view(-1, *rows).index_copy_(0, slot_mapping, kv_format.encode(k))
    v_cache.view(-1, *rows).index_copy_(0, slot_mapping, kv_format.encode(v))


def read_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values at pool `slots` [N] of one layer's k_cache or v_cache, as [N, Hkv, head_dim] in `dtype`."""
    return format_of(cache).to_basis(read_rows(cache, slots, dtype))


def read_rows(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`read_kv` in the pool's basis."""
    return format_of(cache).decode(cache.view(-1, *cache.shape[-2:]).index_select(0, slots), dtype)


def store_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """One layer's attention for a forward: store its new K/V, then attend over the pool (the last `window` keys of
    each query, for a sliding-window layer). Returns [T, H * D]. Over a pool of 8-bit rows, q, k and v go into its
    Hadamard basis and the output comes back (`KVFormat.to_basis`). A decode step in fp32 or bf16 on a CPU, over a
    pool of its dtype or of 8-bit rows, runs as one fused call where kvreuse's kernels are loaded, the basis changes
    included: it encodes the new rows as `store_kv` does, bit for bit, and attends over the decoded rows in fp32 (the
    same numbers up to summation order, and the torch path's rounding of 8-bit values to bf16;
    tests/test_attention.py)."""
    kv_format = format_of(k_cache)
    if meta.decode and meta.context_lens is not None and kernels_read(q.dtype, k_cache) \
            and q.device.type == "cpu" and kernels.load().loaded:
        meta = meta.windowed(window)
        return torch.ops.kvreuse_cpu.decode_attention(q.contiguous(), k.contiguous(), v.contiguous(), k_cache,
                                                      v_cache, meta.slot_mapping, meta.context_slots,
                                                      meta.context_lens, scale, kv_format.rotated)
    q, k, v = (kv_format.to_basis(x) for x in (q, k, v))
    store_rows(k_cache, v_cache, k, v, meta.slot_mapping)
    return _heads_to_basis(kv_format, attend_in_basis(q, k_cache, v_cache, meta, scale, window), q.shape[1])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """q: [T, H, D] (RoPE applied); returns [T, H * D]. The new tokens' K/V must already be stored. On a CPU, a
    step with prompt rows attends one query row at a time (row_attention.py: a row's bits do not depend on its
    neighbours); decode steps and CUDA take SDPA over the padded batch."""
    kv_format = format_of(k_cache)
    out = attend_in_basis(kv_format.to_basis(q), k_cache, v_cache, meta, scale, window)
    return _heads_to_basis(kv_format, out, q.shape[1])


def _heads_to_basis(kv_format: KVFormat, out: torch.Tensor, num_heads: int) -> torch.Tensor:
    """out: [T, H * D] -> each head's vector through `kv_format.to_basis` (back from the pool's basis)."""
    if not kv_format.rotated:
        return out
    return kv_format.to_basis(out.unflatten(-1, (num_heads, -1))).flatten(-2)


def attend_in_basis(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None) -> torch.Tensor:
    """`paged_attention` with q, and so the output, in the pool's basis."""
    if not meta.decode and q.device.type == "cpu":
        row_seq, row_pos = meta.rows()
        return attend_rows(q, k_cache, v_cache, meta.context_slots, row_seq, row_pos, scale, window or 0)
    return padded_attention(q, k_cache, v_cache, meta, scale, window)


def padded_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """`paged_attention` as one SDPA call over the padded batch, in the pool's basis: q [T, H, D] -> [T, H * D]."""
    meta = meta.windowed(window)
    if meta.chunks is not None:
        return torch.cat([padded_attention(q[start:end], k_cache, v_cache, chunk, scale)
                          for start, end, chunk in meta.chunks])
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    num_seqs, max_query_len = meta.query_index.shape
    # Decode rows are already one query per sequence, in batch order: no gather, no padding to drop.
    q_pad = q.unsqueeze(2) if meta.decode else q[meta.query_index].transpose(1, 2)     # [B, H, Q, D]
    slots = meta.context_slots.flatten()                                               # [B * K]
    k = read_rows(k_cache, slots, q.dtype)                                            # [B * K, Hkv, D]
    v = read_rows(v_cache, slots, q.dtype)                                            # [B * K, Hkv, D]
    k = k.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)                   # [B, Hkv, K, D]
    v = v.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)                   # [B, Hkv, K, D]
    mask = None if meta.causal else meta.attn_mask
    out = F.scaled_dot_product_attention(
        q_pad, k, v, attn_mask=mask, is_causal=meta.causal, scale=scale, enable_gqa=num_heads != num_kv_heads
    )                                                                                  # [B, H, Q, D]
    out = out.transpose(1, 2).reshape(num_seqs * max_query_len, num_heads * head_dim)
    return out if meta.decode else out[meta.output_index]
