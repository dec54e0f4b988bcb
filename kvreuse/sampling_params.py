"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

SEED_RANGE = (-2**63, 2**64)  # what torch.Generator.manual_seed takes


class InvalidSamplingParam(ValueError):
    """A sampling setting out of its range; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0     # 0 means greedy
    top_k: int = 0               # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    keep_first_logits: bool = False  # keep the first token's logits on the output (fidelity measurements)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (self.temperature >= 0, "temperature", "a number >= 0"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p", "a number in (0, 1]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings"),
            (self.seed is None or (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]),
             "seed", "an integer in [-2**63, 2**64)"),
        ]
        for ok, name, allowed in checks:
            if not ok:
                raise InvalidSamplingParam(name, f"{name} must be {allowed}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        # Below 1e-5, dividing logits by the temperature overflows; the result is the argmax anyway.
        return self.temperature < 1e-5 or self.top_k == 1
