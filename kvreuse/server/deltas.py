"""What a request's queue carries to the server: its Deltas, the last one with the output, or in its place an end that
is no answer: EngineDied (the engine loop died) or Cut (the server stopped waiting at the drain deadline)."""

from __future__ import annotations

from dataclasses import dataclass

from kvreuse.engine.output import RequestOutput
from kvreuse.engine.stats import EngineSnapshot
from kvreuse.layers.sampler import TokenLogprob


@dataclass
class Delta:
    """New text of one choice of a request since its last delta (choice `index`; a request has one unless n > 1), with
    the logprobs of its new tokens when asked for. `output` is set on the request's last delta (all choices done;
    `output.all_choices` has each one's). On the last one, `error` says why the request failed (a step computing it
    raised; finish_reason "error"), else None."""
    text: str
    output: RequestOutput | None = None
    snapshot: EngineSnapshot | None = None  # from a cluster replica, on the last delta: its engine's snapshot
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # set when choice `index` is done
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the prompt's (echo), on the request's first delta

    @property
    def finished(self) -> bool:
        return self.output is not None

    @property
    def error(self) -> str | None:
        return self.output.error if self.output is not None else None


@dataclass(frozen=True)
class EngineDied:
    """In place of a Delta: the engine loop died (`cause`, the exception's repr); nothing more comes."""
    cause: str


@dataclass(frozen=True)
class Cut:
    """In place of a Delta: the drain deadline passed and the server ended the request; nothing more is read."""


def is_last(item: Delta | EngineDied | Cut) -> bool:
    """Whether `item` ends its request's queue."""
    return not isinstance(item, Delta) or item.finished
