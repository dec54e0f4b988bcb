"""Warming the KV cache offline: `kvreuse cache warm FILE.jsonl` (the CLI twin of the server's `POST /cache/warm`).

Each record's prompt is run as a one-token greedy completion, all of them submitted together (continuous batching),
so its full blocks are computed and published like any request's, and the lower tiers (disk, Redis) get them
through the store's write path. Then `warm` waits for those writes, so a process that exits right after (the CLI)
leaves them on disk or in Redis for the next one. A record's own "max_tokens" and "temperature" are ignored: only
the prompt's KV matters.

The write queue drops what overflows it (a server must never wait on a slow disk); warming is offline work that
nobody waits on, so between steps it lets the writer catch up whenever the queue is more than half full, instead
of dropping blocks. What is dropped anyway is reported.
"""

from __future__ import annotations

import time

from kvreuse.engine.engine import RequestError
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.llm import LLM
from kvreuse.prompts_file import PromptRecord
from kvreuse.sampling_params import SamplingParams

FLUSH_TIMEOUT_S = 300.0


class WarmError(ValueError):
    """A record the engine refuses; the message starts with its line number ("line 3: ...")."""

    def __init__(self, line: int, problem: str):
        super().__init__(f"line {line}: {problem}")
        self.line = line


def warm(llm: LLM, records: list[PromptRecord], cache_salt: str | None = None) -> dict:
    """Compute and store the KV of each record's prompt ({"prompt"}: a raw prompt; {"messages"}: under the chat
    template); wait for the lower tiers to write it. Every record is checked before any is run: WarmError (a
    ValueError) names the line of the first bad one. Returns a summary (keys in the return statement)."""
    engine = llm.engine
    began = time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    seqs = []
    for r in records:
        try:
            prompt = engine.tokenize_chat(r.messages) if r.messages is not None else r.prompt
            seqs.append(engine.make_sequence(prompt, params, cache_salt=cache_salt))
        except (RequestError, ValueError) as exc:
            if isinstance(exc, RequestError) and exc.field == "cache_salt":
                raise  # the same for every record: no line to blame
            raise WarmError(r.line, str(exc)) from exc

    tiers = engine.tiers
    before = tiers.snapshot() if tiers is not None else None
    for seq in seqs:
        engine.add_sequence(seq)
    while engine.has_unfinished():
        engine.step()
        if tiers is not None and tiers.snapshot()["queued_bytes"] > tiers.max_queue_bytes // 2:
            tiers.flush(FLUSH_TIMEOUT_S)  # backpressure: let the writer catch up rather than drop blocks
    flushed = tiers.flush(FLUSH_TIMEOUT_S) if tiers is not None else True

    total = ReuseRecord()
    failed = []
    for seq, r in zip(seqs, records, strict=True):
        out = engine.output(seq)
        if out.error is not None:
            failed.append({"line": r.line, "error": out.error})
        total += out.usage  # its reuse record (Usage is one, plus completion tokens)

    written, errors, dropped = {}, {}, 0
    if tiers is not None:
        after = tiers.snapshot()
        for name in tiers.tier_names:
            was, now = before["tiers"][name], after["tiers"][name]
            written[name] = now["entries_written"] - was["entries_written"]
            errors[name] = now["errors"] - was["errors"]
        dropped = after["dropped_blocks"] - before["dropped_blocks"]
    return {"num_items": len(records), "prompt_tokens": total.prompt_tokens,
            "cached_tokens": total.cached_tokens, "cached_tokens_details": total.cached_by_tier(),
            "reused_tokens": total.reused_tokens, "computed_prompt_tokens": total.computed_prompt_tokens,
            "tiers": tiers.tier_names if tiers is not None else [], "blocks_written": written,
            "write_errors": errors, "dropped_blocks": dropped, "failed": failed,
            "seconds": round(time.perf_counter() - began, 3), "flushed": flushed}
