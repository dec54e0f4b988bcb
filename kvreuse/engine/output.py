"""What a finished (or streaming) request reports back to the caller."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.accounting import ReuseRecord


@dataclass(frozen=True)
class Usage(ReuseRecord):
    """The reuse record of the prompt, plus the completion."""
    completion_tokens: int = 0

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
    error: str | None = None      # set when finish_reason is "error": the step computing it raised this
    tier_load_s: float = 0.0      # time its cached prefix took to load from lower tiers (0: it loaded none)
    replica: str | None = None    # with `kvreuse serve --replicas N`: the replica that computed it

    @classmethod
    def from_sequence(cls, seq: Sequence) -> RequestOutput:
        total = None if seq.finish_time is None else seq.finish_time - seq.arrival_time
        usage = Usage(**seq.reuse_or_planned.as_dict(), completion_tokens=seq.num_completion_tokens)
        return cls(seq.request_id, seq.output_text, seq.completion_token_ids, seq.finish_reason, usage,
                   seq.ttft_s, total, seq.num_preemptions, seq.first_logits, seq.error, seq.kv.load_seconds)

    def to_json(self) -> dict:
        """Flat record, as `kvreuse generate --json` prints it."""
        record = asdict(self)
        record.pop("first_logits")
        for optional in ("error", "replica"):  # only failed requests, and a cluster's, carry these
            if record[optional] is None:
                record.pop(optional)
        record.update(record.pop("usage"))
        return record
