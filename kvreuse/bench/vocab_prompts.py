"""A trace request's prompt as token ids a served model accepts: each hash id becomes a block of `tokens_per_hash`
ids drawn, seeded by (seed, hash id), from the model's ordinary tokens, so that equal hash ids give equal blocks and
different ids, almost surely, different ones. The prompt is cut as `trace.prompt_length` cuts the simulator's, so
both replays see the same prompt lengths and block boundaries."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvreuse.bench.trace import MOONCAKE_HASH_BLOCK_TOKENS, TraceRequest, prompt_length

SMOLLM2_VOCAB_SIZE = 49152
# Ids below this are left out: the special and byte-level tokens sit at the start of common vocabularies
# (SmolLM2's <|endoftext|>, <|im_start|>, <|im_end|> are 0, 1, 2).
FIRST_ORDINARY_ID = 256


@lru_cache(maxsize=1 << 16)
def hash_block(hash_id: int, tokens_per_hash: int, vocab_size: int, seed: int = 0) -> tuple[int, ...]:
    """The `tokens_per_hash` token ids of hash id `hash_id`, in [FIRST_ORDINARY_ID, vocab_size)."""
    rng = np.random.default_rng((seed, hash_id))
    return tuple(int(t) for t in rng.integers(FIRST_ORDINARY_ID, vocab_size, tokens_per_hash))


def vocab_prompt(request: TraceRequest, tokens_per_hash: int, vocab_size: int = SMOLLM2_VOCAB_SIZE,
                 hash_block_tokens: int = MOONCAKE_HASH_BLOCK_TOKENS, seed: int = 0) -> list[int]:
    """The request's prompt: its hash ids' blocks, cut to `prompt_length`."""
    if vocab_size <= FIRST_ORDINARY_ID:
        raise ValueError(f"vocab_size must be above {FIRST_ORDINARY_ID}, got {vocab_size}")
    tokens = [t for h in request.hash_ids for t in hash_block(h, tokens_per_hash, vocab_size, seed)]
    del tokens[prompt_length(request, tokens_per_hash, hash_block_tokens):]
    return tokens
