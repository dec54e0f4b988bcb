"""What the ingress sends a replica: a request already tokenized and validated, in plain picklable fields."""

from __future__ import annotations

from dataclasses import dataclass

from kvreuse.engine.sequence import Sequence
from kvreuse.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    use_cache: bool = True
    # The prompt as text, only for `cluster.routing = ray_prefix`: Ray's character-prefix router reads `.prompt`.
    prompt: str | None = None

    @classmethod
    def of(cls, seq: Sequence, prompt: str | None = None) -> RequestSpec:
        """The spec of a sequence the ingress's front end made (`FrontEnd.make_sequence`)."""
        return cls(seq.request_id, list(seq.prompt_token_ids), seq.params, seq.cache_salt, seq.kv.use_cache, prompt)
