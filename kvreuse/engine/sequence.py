"""Everything the engine knows about one request lives on its Sequence (what the KV cache knows, on its `kv`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from kvreuse.engine.detokenizer import DetokenizedText
from kvreuse.engine.timings import Timings
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.request import CacheRequest
from kvreuse.layers.logits_processors import TokenMask
from kvreuse.layers.sampler import TokenLogprob
from kvreuse.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # a sequence is itself: compared by identity
class Sequence:
    request_id: str
    kv: CacheRequest                  # its tokens, block table, keys and reuse plan, as the KV cache sees them
    params: SamplingParams
    times: Timings = field(default_factory=Timings)  # arrival, first token, finish, tier load
    status: SequenceStatus = SequenceStatus.WAITING
    num_prompt_tokens: int = 0        # set from kv.token_ids at creation
    num_computed_tokens: int = 0      # tokens whose K/V are in the block table
    num_scheduled_tokens: int = 0     # tokens this step computes
    num_preemptions: int = 0
    num_admission_faults: int = 0     # steps whose scheduling raised while this one was the queue's head
    admitted: ReuseRecord | None = None  # what its latest admission took from the cache (the scheduler sets it)
    reuse: ReuseRecord | None = None  # how the prompt was obtained; set after the request's first step
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (a step failed; see `error`)
    error: str | None = None          # why, when finish_reason is "error"
    detokenized: DetokenizedText = field(default_factory=DetokenizedText)  # its completion's confirmed text
    generator: torch.Generator | None = None
    first_logits: torch.Tensor | None = None  # [vocab] fp32, kept when params.keep_first_logits
    cache_salt: str | None = None     # the salt in kv's extra key, for handing the request to another process
    session_key: str | None = None    # its prompt_cache_key (kv.session holds it, salted), and its
    retention: str | None = None      # prompt_cache_retention: for handing the request to another process
    tenant: str | None = None         # whose request (the server's API-key tenant); None offline and without keys
    # n / best_of > 1: the request's sequence is choice 0 and holds every choice (itself first) in `choices`; the
    # others are forked from it once its prompt is computed, sharing its blocks (see LLMEngine._fork).
    index: int = 0
    choices: list[Sequence] = field(default_factory=list)
    parent: Sequence | None = field(default=None, repr=False)  # choice 0, on the other choices
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the completion tokens, when asked for
    cumulative_logprob: float = 0.0   # their sum (best_of ranks choices by it)
    # Scoring the prompt: each position's record known so far (position 0 has none), taken from the cache at admission
    # or computed; the scheduler merges them in.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    grammar: object | None = None     # the compiled response_format (kvreuse.structured), shared by the choices
    matcher: TokenMask | None = None  # the grammar's state along this choice's tokens

    def __post_init__(self):
        self.num_prompt_tokens = self.kv.num_tokens
        if self.params.seed is not None:
            seed = self.params.seed + self.index
            self.generator = torch.Generator().manual_seed(seed - 2**64 if seed >= 2**64 else seed)
        if self.grammar is not None and self.matcher is None:
            self.matcher = self.grammar.matcher()

    @property
    def token_ids(self) -> list[int]:
        """Prompt + completion."""
        return self.kv.token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.kv.token_ids[:self.num_prompt_tokens]

    @property
    def num_tokens(self) -> int:
        return self.kv.num_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.kv.token_ids[self.num_prompt_tokens:]

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
    def group_id(self) -> str:
        """The request id of its request (choice 0's), under which the engine and the server know it."""
        return (self.parent or self).request_id

    @property
    def owner(self) -> str | None:
        """The tenant of its request (choice 0's `tenant`): the scheduler takes tenants in turn."""
        return (self.parent or self).tenant

    @property
    def num_seats(self) -> int:
        """Places in the running batch it takes once admitted: itself and the choices still to be forked from it."""
        return 1 + len(self.unforked_choices)

    @property
    def unforked_choices(self) -> list[Sequence]:
        """The choices still to be forked from this one: they draw their first token beside its first token."""
        return [c for c in self.choices[1:] if not c.num_completion_tokens and not c.is_finished]

    @property
    def group_finished(self) -> bool:
        """Every choice of its request has finished (a request of one choice: itself)."""
        request = self.parent or self
        return all(c.is_finished for c in request.choices) if request.choices else self.is_finished

    @property
    def reuse_or_planned(self) -> ReuseRecord:
        """`reuse`, or for a request that never ran, the whole prompt as computed."""
        return self.reuse or ReuseRecord.planned(self.num_prompt_tokens)
