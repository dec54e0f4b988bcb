"""What a finished (or streaming) request reports back to the caller."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.layers.sampler import TokenLogprob


@dataclass(frozen=True)
class Usage(ReuseRecord):
    """The reuse record of the prompt, plus the completion."""
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def of(cls, seq: Sequence) -> Usage:
        return cls(**seq.reuse_or_planned.as_dict(), completion_tokens=seq.num_completion_tokens)

    def __add__(self, other: Usage) -> Usage:
        return Usage(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(Usage)})


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
    index: int = 0                # which choice this is (n > 1)
    logprobs: list[TokenLogprob] | None = None          # of token_ids, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # of the prompt tokens, when asked for
    cumulative_logprob: float | None = None
    # n > 1: every choice returned, this one first (with best_of, the n of highest cumulative logprob); `usage` then
    # sums them (the prompt counted once). Empty for a request of one choice.
    choices: list[RequestOutput] = field(default_factory=list)

    @classmethod
    def from_sequence(cls, seq: Sequence, index: int | None = None) -> RequestOutput:
        """The output of one sequence (one choice); `LLMEngine.output` gathers a request's choices."""
        p = seq.params
        return cls(seq.request_id, seq.detokenized.text, seq.completion_token_ids, seq.finish_reason, Usage.of(seq),
                   seq.times.ttft_s, seq.times.total_s, seq.num_preemptions, seq.first_logits, seq.error,
                   seq.times.tier_load_s,
                   index=seq.index if index is None else index,
                   logprobs=list(seq.logprobs) if p.logprobs is not None else None,
                   prompt_logprobs=list(seq.prompt_logprobs) if p.prompt_logprobs is not None else None,
                   cumulative_logprob=seq.cumulative_logprob if p.draws_logprobs else None)

    @classmethod
    def of_requests(cls, outputs: list[RequestOutput]) -> RequestOutput:
        """The first output, with the usage of them all (the prompts of one API request)."""
        return replace(outputs[0], usage=sum((o.usage for o in outputs[1:]), outputs[0].usage))

    @property
    def all_choices(self) -> list[RequestOutput]:
        return self.choices or [self]

    def to_json(self) -> dict:
        """Flat record, as `kvreuse generate --json` prints it."""
        record = asdict(self)
        for internal in ("first_logits", "choices", "logprobs", "prompt_logprobs", "cumulative_logprob", "index"):
            record.pop(internal)
        for optional in ("error", "replica"):  # only failed requests, and a cluster's, carry these
            if record[optional] is None:
                record.pop(optional)
        record.update(record.pop("usage"))
        return record
