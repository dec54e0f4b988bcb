"""One record of how prompt tokens were obtained: from the exact prefix cache (held in memory or loaded from a lower
tier), from reused segments, or computed.

The same record describes one request (the engine fills it once the request's first step has run, from what
admission planned and what the repair did) and any number of requests (records add up with `+`). Every report
renders it from its fields: the usage JSON, Prometheus, the per-request cache-hit log, the bench tables. A
field's metadata names its Prometheus counter, so adding a counter here adds it everywhere; the tier split of
cached tokens is one labeled counter instead (`cached_by_tier`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


def _counter(metric: str | None, help_text: str):
    return field(default=0, metadata={"metric": metric, "help": help_text})


@dataclass(frozen=True)
class ReuseRecord:
    """Invariants: prompt = cached + reused + computed; shifted <= reused; recomputed <= reused; cached from disk
    + cached from Redis <= cached (the rest was held in memory).
    Prefill work (tokens run through the model for the prompt) = computed + recomputed + discarded."""

    prompt_tokens: int = _counter("vllm:prompt_tokens", "Prompt tokens of finished requests")
    cached_tokens: int = _counter("vllm:prefix_cache_hits", "Prompt tokens served from the exact prefix cache")
    reused_tokens: int = _counter("kvreuse:reused_prompt_tokens",
                                  "Prompt tokens whose K/V were copied from cached segments (approximate)")
    shifted_tokens: int = _counter("kvreuse:shifted_prompt_tokens",
                                   "Reused prompt tokens that moved position (K re-rotated)")
    recomputed_tokens: int = _counter("kvreuse:recomputed_prompt_tokens",
                                      "Reused tokens computed again by the repair (never counted as hits)")
    discarded_tokens: int = _counter("kvreuse:discarded_prompt_tokens",
                                     "Token work of approximate passes the fidelity guard threw away")
    computed_prompt_tokens: int = _counter("kvreuse:computed_prompt_tokens", "Prompt tokens computed fresh")
    guarded_requests: int = _counter("kvreuse:guarded_requests",
                                     "Requests whose reused part the fidelity guard recomputed exactly")
    cached_tokens_disk: int = _counter(None, "Of cached_tokens, loaded from the disk tier")
    cached_tokens_redis: int = _counter(None, "Of cached_tokens, loaded from the Redis tier")

    def __post_init__(self):
        assert self.prompt_tokens == self.cached_tokens + self.reused_tokens + self.computed_prompt_tokens, self
        assert self.shifted_tokens <= self.reused_tokens and self.recomputed_tokens <= self.reused_tokens, self
        assert self.cached_tokens_disk + self.cached_tokens_redis <= self.cached_tokens, self

    @classmethod
    def planned(cls, num_prompt_tokens: int, num_cached_tokens: int = 0, num_reused_tokens: int = 0,
                num_shifted_tokens: int = 0, num_loaded_tokens: dict[str, int] | None = None) -> ReuseRecord:
        """What admission decided: the rest of the prompt is computed. `num_loaded_tokens`: of the cached tokens,
        how many were loaded from each lower tier."""
        loaded = num_loaded_tokens or {}
        return cls(num_prompt_tokens, num_cached_tokens, num_reused_tokens, num_shifted_tokens,
                   computed_prompt_tokens=num_prompt_tokens - num_cached_tokens - num_reused_tokens,
                   cached_tokens_disk=loaded.get("disk", 0), cached_tokens_redis=loaded.get("redis", 0))

    def cached_by_tier(self) -> dict[str, int]:
        """Where the cached tokens came from: held in the pool's memory, or loaded from disk or Redis."""
        return {"memory": self.cached_tokens - self.cached_tokens_disk - self.cached_tokens_redis,
                "disk": self.cached_tokens_disk, "redis": self.cached_tokens_redis}

    def __add__(self, other: ReuseRecord) -> ReuseRecord:
        return ReuseRecord(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(ReuseRecord)})

    @property
    def prefill_work_tokens(self) -> int:
        return self.computed_prompt_tokens + self.recomputed_tokens + self.discarded_tokens

    @property
    def hit_rate(self) -> float:
        """Exact prefix hits / prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def approximate_hit_rate(self) -> float:
        """Reused tokens not recomputed / prompt tokens."""
        return (self.reused_tokens - self.recomputed_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @staticmethod
    def field_names() -> list[str]:
        return [f.name for f in fields(ReuseRecord)]

    @staticmethod
    def metrics() -> list[tuple[str, str, str]]:
        """(field, Prometheus counter name, help) for every field with a counter of its own."""
        return [(f.name, f.metadata["metric"], f.metadata["help"]) for f in fields(ReuseRecord)
                if f.metadata["metric"]]
