"""Everything the engine knows about one request lives on its Sequence."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from kvreuse.kvcache.segment import SegmentPlan
from kvreuse.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(default_factory=list)   # prompt + completion
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0      # tokens whose K/V are in the block table
    num_scheduled_tokens: int = 0     # tokens this step computes
    num_cached_tokens: int = 0        # prompt tokens reused from the exact prefix cache at first admission
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    output_text: str = ""
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None
    cache_salt: str | None = None     # requests with different salts never share KV blocks
    use_cache: bool = True            # per-request opt-out of KV reuse
    extra_key: bytes = b""            # model fingerprint + block size + salt, part of every block key
    block_keys: list[bytes] = field(default_factory=list)  # chain keys of the full blocks, in order
    block_uids: list[int] = field(default_factory=list)    # uid each full block's contents got in the pool
    # Segment reuse: the plan is applied by the next prefill; K/V at or after `num_exact_tokens` are
    # approximate (they attended to reused K/V) and are never published to the cache.
    segment_plan: SegmentPlan | None = None
    num_exact_tokens: int = 1 << 62
    num_reused_tokens: int = 0        # prompt tokens whose K/V came from cached segments (approximate)
    num_shifted_tokens: int = 0       # of those, reused at another position (K re-rotated)
    num_recomputed_tokens: int = 0    # reused tokens computed again by the repair (never counted as hits)
    guarded: bool = False             # the fidelity guard recomputed the reused part exactly
    num_discarded_tokens: int = 0     # token work of the approximate pass the guard threw away
    first_logits: torch.Tensor | None = None  # [vocab] fp32, kept when params.keep_first_logits

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens computed fresh: neither an exact prefix hit nor a reused segment."""
        return self.num_prompt_tokens - self.num_cached_tokens - self.num_reused_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """Not a decode: prompt tokens still lack K/V, or more than the newest token does (a recompute)."""
        return self.num_computed_tokens < self.num_prompt_tokens or self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time
