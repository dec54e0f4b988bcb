"""What a finished (or streaming) request reports back to the caller."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvreuse.engine.sequence import Sequence


@dataclass
class Usage:
    """prompt_tokens == cached_tokens + reused_tokens + computed_prompt_tokens; prefill work is
    computed_prompt_tokens + recomputed_tokens + discarded_tokens."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int            # exact prefix hits
    computed_prompt_tokens: int   # computed fresh (not reused)
    reused_tokens: int = 0        # approximate segment hits (K/V copied from another context)
    recomputed_tokens: int = 0    # reused tokens computed again by the repair (not hits)
    shifted_tokens: int = 0       # reused tokens that moved position (K re-rotated)
    guarded: bool = False         # the fidelity guard recomputed the reused part exactly
    discarded_tokens: int = 0     # token work of the approximate pass the guard threw away

    @property
    def prefill_work_tokens(self) -> int:
        return self.computed_prompt_tokens + self.recomputed_tokens + self.discarded_tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class RequestOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    ttft_s: float | None
    total_s: float | None
    num_preemptions: int
    first_logits: object = None   # torch.Tensor [vocab] when SamplingParams.keep_first_logits

    @classmethod
    def from_sequence(cls, seq: Sequence) -> RequestOutput:
        total = None if seq.finish_time is None else seq.finish_time - seq.arrival_time
        usage = Usage(seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_cached_tokens,
                      seq.num_computed_prompt_tokens, seq.num_reused_tokens,
                      seq.num_recomputed_tokens, seq.num_shifted_tokens, seq.guarded, seq.num_discarded_tokens)
        return cls(seq.request_id, seq.output_text, seq.completion_token_ids, seq.finish_reason, usage,
                   seq.ttft_s, total, seq.num_preemptions, seq.first_logits)

    def to_json(self) -> dict:
        """Flat record, as `kvreuse generate --json` prints it."""
        record = asdict(self)
        record.pop("first_logits")
        record.update(record.pop("usage"))
        return record
