"""What `kvreuse bench engine` times, and the engine settings every timed request fits in; apart from the bench so
that the command line reads the defaults without importing the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvreuse.kvcache.layout import KVLayout

BLOCK_SIZE = 16  # cache.block_size's default, which the bench keeps


@dataclass(frozen=True)
class Sizes:
    """What is timed: a cold prefill of each of `prefill_lengths` tokens, and `decode_tokens` greedy tokens after a
    `decode_prompt_len`-token prompt, for each batch size of `decode_batches`."""
    prefill_lengths: tuple[int, ...] = (512, 2048)
    decode_prompt_len: int = 128
    decode_tokens: int = 64
    decode_batches: tuple[int, ...] = (1, 8)

    def metrics(self) -> list[str]:
        return [f"prefill_{n}_tok_s" for n in self.prefill_lengths] + [f"decode_b{b}_tok_s"
                                                                        for b in self.decode_batches]

    def engine_settings(self, layout: KVLayout | None = None) -> list[str]:
        """The engine config keys that fit every timed request: batch, context limit, pool. `layout`: the model's
        pool layout, whose window groups hold blocks of their own (None: one group, every layer)."""
        batch, prefill = max(self.decode_batches), max(self.prefill_lengths)
        decode_len, step = self.decode_prompt_len + self.decode_tokens, max(2048, prefill)

        def blocks_of(num_tokens: int) -> int:
            if layout is None:
                return math.ceil(num_tokens / BLOCK_SIZE)
            return layout.max_blocks_of(num_tokens, BLOCK_SIZE, step)

        num_blocks = max(blocks_of(prefill + 1), batch * blocks_of(decode_len + BLOCK_SIZE))
        return [f"engine.max_num_seqs={max(16, batch)}", f"server.max_tokens={max(8192, prefill + 1, decode_len)}",
                f"engine.num_kv_blocks={num_blocks + batch + 1}", f"engine.max_num_batched_tokens={step}"]
