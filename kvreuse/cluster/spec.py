"""What the ingress sends a replica: a request already tokenized and validated, in plain picklable fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
    # A kvreuse.structured.CheckedFormat: the ingress checked it (limits, compile time), the replica compiles it.
    response_format: object | None = None
    session_key: str | None = None    # prompt_cache_key: the router keeps the session on one replica
    retention: str | None = None      # prompt_cache_retention

    @classmethod
    def of(cls, seq: Sequence, prompt: str | None = None) -> RequestSpec:
        """The spec of a sequence the ingress's front end made (`FrontEnd.make_sequence`)."""
        response_format = None
        if seq.grammar is not None:  # checked, or compiled (which checks first): checked either way
            from kvreuse.structured import CheckedFormat  # xgrammar, only for a request with a format

            response_format = CheckedFormat(seq.grammar.spec)
        return cls(seq.request_id, list(seq.prompt_token_ids), seq.params, seq.cache_salt, seq.kv.use_cache, prompt,
                   response_format, seq.session_key, seq.retention)


@dataclass(frozen=True)
class AdminSpec:
    """Admin work for one replica, by name (the router sends it there): drop its cached blocks (`tiers`: and empty
    its lower tiers), or report its engine snapshot."""
    replica: str
    operation: Literal["reset_prefix_cache", "stats"]
    tiers: bool = False
