"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SEED_RANGE = (-2**63, 2**64)  # what torch.Generator.manual_seed takes
MAX_LOGPROBS = 20             # OpenAI's bound on top alternatives per token
MAX_CHOICES = 16              # n and best_of: each choice is a sequence in the batch


class InvalidSamplingParam(ValueError):
    """A sampling setting out of its range; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 256        # 0 only with prompt_logprobs: score the prompt, generate nothing
    temperature: float = 0.0     # 0 means greedy
    top_k: int = 0               # 0 means off
    top_p: float = 1.0
    seed: int | None = None      # choice i of n draws from seed + i
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # finish on these too (kept in the output, as EOS is)
    ignore_eos: bool = False
    min_tokens: int = 0          # EOS and stop_token_ids are masked until this many tokens exist
    n: int = 1                   # choices returned
    best_of: int | None = None   # choices generated (>= n); the n of highest cumulative logprob are returned
    logprobs: int | None = None  # per generated token: its logprob and the top `logprobs` alternatives
    prompt_logprobs: int | None = None  # per prompt token (echo), likewise; served from the cache when it holds them
    presence_penalty: float = 0.0   # OpenAI's: subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # vLLM's (CTRL's): logits of tokens in the prompt or output divided (> 0) by it
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    keep_first_logits: bool = False  # keep the first token's logits on the output (fidelity measurements)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (_is_int(self.max_tokens) and self.max_tokens >= (0 if self.prompt_logprobs is not None else 1),
             "max_tokens", "an integer >= 1 (0 only when scoring the prompt: echo with logprobs)"),
            (self.temperature >= 0, "temperature", "a number >= 0"),
            (_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p", "a number in (0, 1]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings"),
            (all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "a list of token ids"),
            (self.seed is None or (_is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]),
             "seed", "an integer in [-2**63, 2**64)"),
            (_is_int(self.min_tokens) and 0 <= self.min_tokens <= max(self.max_tokens, 0), "min_tokens",
             "an integer in [0, max_tokens]"),
            (_is_int(self.n) and 1 <= self.n <= MAX_CHOICES, "n", f"an integer in [1, {MAX_CHOICES}]"),
            (self.best_of is None or (_is_int(self.best_of) and self.n <= self.best_of <= MAX_CHOICES), "best_of",
             f"an integer in [n, {MAX_CHOICES}]"),
            (self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
             f"an integer in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                              and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             "prompt_logprobs", f"an integer in [0, {MAX_LOGPROBS}]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "a number in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "a number in [-2, 2]"),
            (0 < self.repetition_penalty <= 2, "repetition_penalty", "a number in (0, 2]"),
            (all(_is_int(t) and t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias.items()), "logit_bias",
             "a map of token ids to numbers in [-100, 100]"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise InvalidSamplingParam(name, f"{name} must be {allowed}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        # Below 1e-5, dividing logits by the temperature overflows; the result is the argmax anyway.
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def num_sequences(self) -> int:
        """Sequences generated for the request: best_of, else n."""
        return self.best_of or self.n

    @property
    def ranks_choices(self) -> bool:
        """best_of > n: the choices are ranked by their cumulative logprob."""
        return self.num_sequences > self.n

    @property
    def draws_logprobs(self) -> bool:
        """The sampler computes each drawn token's logprob: asked for, or needed to rank the choices."""
        return self.logprobs is not None or self.ranks_choices

    @property
    def processes_logits(self) -> bool:
        """Anything between the model's logits and the temperature: penalties, biases, min_tokens."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def token_ids_in_range(self, vocab_size: int) -> str | None:
        """The first field naming a token id outside [0, vocab_size), or None."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            if any(t >= vocab_size for t in ids):
                return name
        return None
