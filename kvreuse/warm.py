"""Warming: running prompts only for what they leave behind. The one path for `kvreuse cache warm FILE.jsonl` (here,
offline), the server's `POST /cache/warm` (routes_cache.py: the same requests, through the server's queue) and the
engine's warm-up before it serves (`warm_up`).

Each record's prompt is run as a one-token greedy completion (`WARM_PARAMS`), all of them submitted together
(continuous batching), so its full blocks are computed and published like any request's, and the lower tiers (disk,
Redis) get them through the store's write path. Then `warm` waits for those writes, so a process that exits right
after (the CLI) leaves them on disk or in Redis for the next one. A record's own "max_tokens" and "temperature" are
ignored: only the prompt's KV matters.

The write queue drops what overflows it (a server must never wait on a slow disk); warming is offline work that
nobody waits on, so between steps it lets the writer catch up whenever the queue is more than half full, instead
of dropping blocks. What is dropped anyway, and what a tier did not store (a full or read-only disk, Redis down), is
reported: `tiers_written` is true only when nothing was lost (`TierWrites`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvreuse.engine.engine import LLMEngine
from kvreuse.engine.errors import RequestError
from kvreuse.engine.front_end import FrontEnd
from kvreuse.engine.output import RequestOutput
from kvreuse.engine.sequence import Sequence
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.tiers.store import TieredStore
from kvreuse.llm import LLM
from kvreuse.prompts_file import PromptRecord
from kvreuse.sampling_params import SamplingParams

FLUSH_TIMEOUT_S = 300.0
WARM_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)  # one greedy token: the prompt's KV is what it leaves


@dataclass(frozen=True)
class TierWrites:
    """What the tiers did between two snapshots of the store (other requests' writes included, in a server)."""

    written: dict[str, int]       # tier -> entries written
    not_written: dict[str, int]   # tier -> entries a put did not store (a fault, no room, Redis down)
    errors: dict[str, int]        # tier -> faults of its medium
    dropped: int                  # blocks the full write queue dropped before any tier saw them
    flushed: bool                 # the queue was empty at the end

    @property
    def complete(self) -> bool:
        """Every block queued reached every tier: the queue drained, dropped nothing, and no tier failed a put."""
        return self.flushed and self.dropped == 0 and not any(self.not_written.values())

    def summary(self) -> dict:
        return {"tiers_written": self.complete, "blocks_written": self.written,
                "blocks_not_written": self.not_written, "write_errors": self.errors, "dropped_blocks": self.dropped,
                "flushed": self.flushed}


def tier_writes(tiers: TieredStore | None, before: dict | None, flushed: bool) -> TierWrites:
    """The tiers' writes since `before` (`tiers.snapshot()`, None without tiers)."""
    if tiers is None:
        return TierWrites({}, {}, {}, 0, flushed)
    after = tiers.snapshot()

    def delta(counter: str) -> dict[str, int]:
        return {name: after["tiers"][name][counter] - before["tiers"][name][counter] for name in tiers.tier_names}

    return TierWrites(delta("entries_written"), delta("entries_dropped"), delta("errors"),
                      after["dropped_blocks"] - before["dropped_blocks"], flushed)


class WarmError(ValueError):
    """A record the engine refuses; the message starts with its line number ("line 3: ...")."""

    def __init__(self, line: int, problem: str):
        super().__init__(f"line {line}: {problem}")
        self.line = line


def warm_up(engine: LLMEngine) -> LLMEngine:
    """One tiny request through the engine, so the first client's does not pay for lazy initialization; `engine`."""
    run_to_completion(engine, [engine.front_end.make_sequence("warm up", SamplingParams(max_tokens=2),
                                                              use_cache=False)])
    return engine


def run_to_completion(engine: LLMEngine, seqs: list[Sequence], between_steps: Callable[[], None] | None = None
                      ) -> None:
    """Queue `seqs` on `engine` (this thread owns it) and step until nothing is left to run."""
    for seq in seqs:
        engine.add_sequence(seq)
    while engine.has_unfinished():
        engine.step()
        if between_steps is not None:
            between_steps()


def prompt_usage(outputs: Iterable[RequestOutput]) -> ReuseRecord:
    """How the prompts of `outputs` were obtained, summed (a Usage is a reuse record, plus completion tokens)."""
    total = ReuseRecord()
    for out in outputs:
        total += out.usage
    return total


def warm(llm: LLM, records: list[PromptRecord], cache_salt: str | None = None) -> dict:
    """Compute and store the KV of each record's prompt ({"prompt"}: a raw prompt; {"messages"}: under the chat
    template); wait for the lower tiers to write it. Every record is checked before any is run: WarmError (a
    ValueError) names the line of the first bad one. Returns a summary (keys in the return statement)."""
    engine = llm.engine
    began = time.perf_counter()
    seqs = warm_sequences(engine.front_end, records, cache_salt)
    tiers = engine.tiers
    before = tiers.snapshot() if tiers is not None else None
    run_to_completion(engine, seqs, (lambda: _let_writer_catch_up(tiers)) if tiers is not None else None)
    flushed = tiers.flush(FLUSH_TIMEOUT_S) if tiers is not None else True
    outputs = [engine.output(seq) for seq in seqs]
    failed = [{"line": r.line, "error": out.error} for out, r in zip(outputs, records, strict=True)
              if out.error is not None]
    total = prompt_usage(outputs)
    return {"num_items": len(records), "prompt_tokens": total.prompt_tokens,
            "cached_tokens": total.cached_tokens, "cached_tokens_details": total.cached_by_tier(),
            "reused_tokens": total.reused_tokens, "computed_prompt_tokens": total.computed_prompt_tokens,
            "tiers": tiers.tier_names if tiers is not None else [], **tier_writes(tiers, before, flushed).summary(),
            "failed": failed, "seconds": round(time.perf_counter() - began, 3)}


def warm_sequences(front: FrontEnd, records: list[PromptRecord], cache_salt: str | None) -> list[Sequence]:
    """The sequence of each record, checked: WarmError names the line of the first the front end refuses."""
    seqs = []
    for r in records:
        try:
            prompt = front.tokenize_chat(r.messages) if r.messages is not None else r.prompt
            seqs.append(front.make_sequence(prompt, WARM_PARAMS, cache_salt=cache_salt))
        except (RequestError, ValueError) as exc:
            if isinstance(exc, RequestError) and exc.field == "cache_salt":
                raise  # the same for every record: no line to blame
            raise WarmError(r.line, str(exc)) from exc
    return seqs


def _let_writer_catch_up(tiers: TieredStore) -> None:
    """Backpressure: with the write queue more than half full, wait for the writer rather than drop blocks."""
    if tiers.snapshot()["queued_bytes"] > tiers.max_queue_bytes // 2:
        tiers.flush(FLUSH_TIMEOUT_S)
