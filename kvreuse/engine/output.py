"""What a finished (or streaming) request reports back to the caller."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvreuse.engine.sequence import Sequence


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int            # prompt tokens served from the exact prefix cache
    computed_prompt_tokens: int   # prompt tokens the model computed for this request

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

    @classmethod
    def from_sequence(cls, seq: Sequence) -> RequestOutput:
        total = None if seq.finish_time is None else seq.finish_time - seq.arrival_time
        usage = Usage(seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_cached_tokens,
                      seq.num_prompt_tokens - seq.num_cached_tokens)
        return cls(seq.request_id, seq.output_text, seq.completion_token_ids, seq.finish_reason, usage,
                   seq.ttft_s, total, seq.num_preemptions)

    def to_json(self) -> dict:
        """Flat record, as `kvreuse generate --json` prints it."""
        record = asdict(self)
        record.update(record.pop("usage"))
        return record
