"""Builds one forward's tensors from scheduled sequences, runs the model over the paged KV pool, samples.

Sequences that reuse cached segments ride in the same forward as the rest of the batch; repair.py repairs their
reused K/V and says what it recomputed. Logits are computed only for the rows that need them: each sampling
sequence's last row, and every prompt row of a sequence scoring its prompt (in slices, so a long prompt never holds
[T, vocab] logits at once)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvreuse.config import SegmentConfig
from kvreuse.engine.repair import RepairOutcome, forward_reusing
from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.block_pool import num_physical_blocks
from kvreuse.kvcache.layout import KVLayout
from kvreuse.kvcache.pool_memory import zeroed
from kvreuse.layers.attention import AttentionMetadata
from kvreuse.layers.kv_format import KVFormat
from kvreuse.layers.logits_processors import SamplingRow
from kvreuse.layers.row_kinds import PROMPT, RowKinds, row_kinds
from kvreuse.layers.sampler import TokenLogprob, sample_rows
from kvreuse.model.decode_graph import DecodeGraph
from kvreuse.model.decoder import CausalLM, ForwardKV, layer_caches

PROMPT_LOGITS_ROWS = 256  # prompt rows turned into logits at once: [256, vocab] fp32 is 48 MiB for a 48K vocabulary


Draw = tuple[int, TokenLogprob | None]  # a sampled token, and its logprob when asked for


@dataclass
class StepOutput:
    # Per scheduled sequence: None if its step does not reach its last token, else the token drawn for it, then one
    # for each of its unforked choices (n > 1), in order.
    draws: list[list[Draw] | None]
    # Per request id that scores its prompt: (first position, the records of the positions this step computed).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)
    outcomes: dict[str, RepairOutcome] = field(default_factory=dict)  # of sequences that reused segments

    @staticmethod
    def merged(seqs: list[Sequence], parts: list[tuple[list[Sequence], StepOutput]]) -> StepOutput:
        """One step's output for `seqs` from the outputs of forwards over parts of them."""
        draws = {id(seq): draw for part, out in parts for seq, draw in zip(part, out.draws, strict=True)}
        merged = StepOutput([draws[id(seq)] for seq in seqs])
        for _, out in parts:
            merged.prompt_logprobs.update(out.prompt_logprobs)
            merged.outcomes.update(out.outcomes)
        return merged


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_format: KVFormat, device: torch.device,
                 eos_token_ids: frozenset[int] = frozenset(), decode_graph: DecodeGraph | None = None,
                 layout: KVLayout | None = None):
        args = model.args
        self.model, self.block_size, self.device = model, block_size, device
        self.layout = layout or KVLayout.full(args.num_layers)
        self.decode_graph = decode_graph  # the compiled decode step, used once it is ready
        self.eos_token_ids = eos_token_ids  # masked, with stop_token_ids, until min_tokens
        # [layers_per_block, K/V, num_blocks + 1 (the null block), block_size, num_kv_heads, W]: rows of W storage
        # elements in `kv_format` (W = head_dim, or head_dim + its scale's bytes in 8 bits)
        self.kv_cache = zeroed((self.layout.layers_per_block, 2, num_physical_blocks(num_blocks), block_size,
                                args.num_kv_heads, kv_format.row_width(args.head_dim)), kv_format.storage, device)
        slots = layer_caches(self.kv_cache)
        self.layer_caches = [slots[j] for j in self.layout.slot_of]  # each model layer's (k_cache, v_cache) views

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], segments: SegmentConfig) -> StepOutput:
        """Compute each sequence's `num_scheduled_tokens` tokens from `num_computed_tokens` on. A sequence with a
        segment plan is scheduled whole and reuses the plan's K/V, repaired per `segments` (see repair.py). A sequence
        whose step reaches its last token draws the next one (and one per unforked choice)."""
        decoding = [s for s in seqs if s.num_computed_tokens >= s.num_prompt_tokens]
        if 0 < len(decoding) < len(seqs) and self._graph_takes(sum(s.num_scheduled_tokens for s in decoding)):
            # Decode rows riding along with prompt chunks get a forward of their own through the compiled step: the
            # bits a decode step gives them, whatever else the step holds (docs/design/batch-invariance.md).
            prompting = [s for s in seqs if s.num_computed_tokens < s.num_prompt_tokens]
            return StepOutput.merged(seqs, [(decoding, self._run(decoding, segments)),
                                            (prompting, self._run(prompting, segments))])
        return self._run(seqs, segments)

    def _graph_takes(self, num_rows: int) -> bool:
        """Whether the compiled step takes a decode step of `num_rows` rows."""
        return self.decode_graph is not None and self.decode_graph.can_run(num_rows)

    def _run(self, seqs: list[Sequence], segments: SegmentConfig) -> StepOutput:
        starts = [s.num_computed_tokens for s in seqs]
        lens = [s.num_scheduled_tokens for s in seqs]
        input_ids = torch.tensor([t for s, a, n in zip(seqs, starts, lens, strict=True) for t in s.token_ids[a:a + n]],
                                 device=self.device)                                   # [T]
        positions = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lens, strict=True)])  # [T]
        offsets = [0, *torch.tensor(lens).cumsum(0).tolist()]
        samples = [a + n == s.num_tokens for s, a, n in zip(seqs, starts, lens, strict=True)]
        sample_rows = [offsets[i + 1] - 1 for i, s in enumerate(samples) if s]
        prompt_rows = {i: range(a, min(a + n, s.num_prompt_tokens - 1))            # rows r score position r + 1
                       for i, (s, a, n) in enumerate(zip(seqs, starts, lens, strict=True))
                       if s.kv.prompt_logprobs is not None and a < s.num_prompt_tokens - 1}
        rows = sorted({*sample_rows, *(offsets[i] + r - starts[i] for i, rs in prompt_rows.items() for r in rs)})
        rows_t = torch.tensor(rows, dtype=torch.long)                                  # [R] ascending
        metas = [AttentionMetadata.build(starts, lens, [s.kv.block_tables[g] for s in seqs], self.block_size,
                                         self.device) for g in range(len(self.layout.groups))]
        kv = ForwardKV(self.layer_caches, [metas[g] for g in self.layout.group_of])
        # A row that computes a prompt token runs eagerly, and takes the products prompt rows take, whatever else its
        # step holds: the cold prompt's rows and a cache hit's suffix rows then get the same bits
        # (docs/design/batch-invariance.md). The compiled step runs generated rows only.
        is_prompt = [a + j < s.num_prompt_tokens for s, a, n in zip(seqs, starts, lens, strict=True) for j in range(n)]
        out = StepOutput([None] * len(seqs))
        with row_kinds(RowKinds.of(is_prompt, self.device)):
            if any(s.kv.pending.segment_plan is not None for s in seqs):
                assert not self.layout.is_grouped, "segment reuse runs on a pool of one group"
                hidden, out.outcomes = forward_reusing(self.model, self.kv_cache, seqs, input_ids, positions,
                                                       metas[0], rows_t, segments)
            elif not any(is_prompt) and self._graph_takes(len(input_ids)):
                hidden = self.decode_graph.run(input_ids, positions.to(self.device), kv)  # [T, hidden]
                if len(rows) < len(input_ids):
                    hidden = hidden[rows_t.to(self.device)]                            # [R, hidden]
            else:
                hidden = self.model.hidden_states(input_ids, positions.to(self.device), kv,
                                                  rows_t.to(self.device))              # [R, hidden]
        index_of = {row: k for k, row in enumerate(rows)}
        for i, scored in prompt_rows.items():
            h = hidden[[index_of[offsets[i] + r - starts[i]] for r in scored]]
            out.prompt_logprobs[seqs[i].request_id] = (scored.start + 1, self._prompt_logprobs(seqs[i], scored, h))
        if sample_rows:  # a batch that scores no prompt has exactly its sampling rows, in order: no gather
            self._draw(seqs, samples, hidden[[index_of[r] for r in sample_rows]] if prompt_rows else hidden, out)
        return out

    def _draw(self, seqs: list[Sequence], samples: list[bool], hidden: torch.Tensor, out: StepOutput) -> None:
        """Sample the next token of every sampling sequence (hidden: [S, hidden], their last rows), and of each of its
        unforked choices from the same logits."""
        sampling = [seq for seq, s in zip(seqs, samples, strict=True) if s]
        logits = self.model.compute_logits(hidden)                                     # [S, vocab]
        for row, seq in enumerate(sampling):
            if seq.params.keep_first_logits and seq.first_logits is None:
                seq.first_logits = logits[row].cpu()
        drawers = [[seq, *seq.unforked_choices] for seq in sampling]
        if any(len(d) > 1 for d in drawers):
            repeat = torch.tensor([len(d) for d in drawers], device=logits.device)
            logits = logits.repeat_interleave(repeat, dim=0)                          # [S', vocab]
        flat = [c for d in drawers for c in d]
        token_ids, logprobs = sample_rows(logits, [self._sampling_row(c) for c in flat])
        draws = iter(zip(token_ids, logprobs, strict=True))
        per_seq = iter([[next(draws) for _ in d] for d in drawers])
        out.draws = [next(per_seq) if s else None for s in samples]

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        p = seq.params
        if not p.processes_logits:
            return SamplingRow(p, seq.generator, grammar=seq.matcher)
        stop_ids = self.eos_token_ids | frozenset(p.stop_token_ids) if not p.ignore_eos else frozenset(p.stop_token_ids)
        return SamplingRow(p, seq.generator, seq.prompt_token_ids, seq.completion_token_ids, seq.matcher, stop_ids)

    def _prompt_logprobs(self, seq: Sequence, scored: range, hidden: torch.Tensor) -> list[TokenLogprob]:
        """The model's own logprob of each prompt token after the rows `scored` (hidden: [len(scored), hidden]), with
        the top `seq.kv.prompt_logprobs` alternatives (no rank: no response shows it, and it costs a pass over the
        vocabulary per row)."""
        num_top = seq.kv.prompt_logprobs
        next_ids = torch.tensor(seq.token_ids[scored.start + 1:scored.stop + 1], device=hidden.device)  # [R]
        records: list[TokenLogprob] = []
        for a in range(0, len(scored), PROMPT_LOGITS_ROWS):
            with row_kinds(PROMPT):
                logits = self.model.compute_logits(hidden[a:a + PROMPT_LOGITS_ROWS])  # [r, V]
            norm = logits.logsumexp(dim=1, keepdim=True)                               # [r, 1]: log-softmax's shift
            ids = next_ids[a:a + PROMPT_LOGITS_ROWS]
            chosen = (logits.gather(1, ids[:, None]) - norm)[:, 0].tolist()           # [r]
            if num_top:
                top_values, top_ids = logits.topk(num_top, dim=1)
                top_values = (top_values - norm).tolist()
                top_ids = top_ids.tolist()
            for j, (token_id, value) in enumerate(zip(ids.tolist(), chosen, strict=True)):
                top = tuple(zip(top_ids[j], top_values[j], strict=True)) if num_top else ()
                records.append(TokenLogprob(token_id, value, None, top))
        return records

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy the K/V a block holds from block `source` to block `destination`, for each pair (copy on write)."""
        for source, destination in copies:
            self.kv_cache[:, :, destination] = self.kv_cache[:, :, source]
