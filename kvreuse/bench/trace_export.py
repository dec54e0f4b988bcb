"""A Mooncake-format trace made from the scenario workloads (`kvreuse bench scenario-trace`): the second trace that
eviction policies are measured on, shaped unlike Mooncake's own.

Sessions arrive as a Poisson process; each is a multi-turn chat under the shared chat system prompt, a chat about
its own documents, or one request of the RAG, agent, batch-eval or shared-prefix workloads. A session's turns
follow each other after exponential think times, so sessions interleave. Prompts are rendered with the model's
chat template and tokenized, cut into blocks of `hash_block_tokens`, and each block gets the id of its chain
(its parent's id and its tokens; a partial last block too, as Mooncake's hash ids cover the whole prompt), ids
numbered in order of first appearance. Unlike Mooncake's trace, prompts here share system prompts across sessions,
and many requests are never reused.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvreuse.bench import workloads
from kvreuse.bench.trace import TraceRequest

# Session kinds and how often each opens a session.
KINDS = {"chat": 0.3, "document_chat": 0.3, "rag": 0.15, "agent": 0.1, "eval": 0.05, "prefix": 0.1}
MAX_TURNS = 8


@dataclass(frozen=True)
class SessionMix:
    """The trace's shape: sessions, their arrival rate, the mean think time between turns, the mean turns of a
    multi-turn session (1 + geometric, at most MAX_TURNS)."""
    num_sessions: int = 600
    sessions_per_second: float = 0.6
    think_seconds: float = 40.0
    mean_turns: float = 3.0
    seed: int = 0


def _session(kind: str, turns: int, seed: int, rng: random.Random) -> list[list[dict]]:
    """One session's requests (chat messages), in order."""
    if kind == "chat":
        return workloads.chat(turns, turns=turns, seed=seed)
    if kind == "document_chat":
        return workloads.document_chat(turns, turns=turns, seed=seed)
    if kind == "rag":
        return workloads.rag(1, seed=seed)
    if kind == "agent":
        return workloads.agent(1, seed=seed)
    if kind == "eval":
        return [[{**m, "content": m["content"].replace("#1", f"#{seed}")} for m in workloads.batch_eval(1, seed)[0]]]
    return [rng.choice(workloads.generated_shared_prefix(4, 1, seed=0))]


def _turns(mix: SessionMix, rng: random.Random) -> int:
    turns = 1
    while turns < MAX_TURNS and rng.random() > 1 / mix.mean_turns:
        turns += 1
    return turns


def schedule(mix: SessionMix) -> list[tuple[float, str, list[dict]]]:
    """Every request as (arrival seconds, session kind, messages), in arrival order."""
    rng = random.Random(mix.seed)
    arrivals = []
    start = 0.0
    for index in range(mix.num_sessions):
        start += rng.expovariate(mix.sessions_per_second)
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        turns = _turns(mix, rng) if kind in ("chat", "document_chat") else 1
        at = start
        for messages in _session(kind, turns, mix.seed * 1_000_003 + index, rng):
            arrivals.append((at, kind, messages))
            at += rng.expovariate(1 / mix.think_seconds)
    return sorted(arrivals, key=lambda a: a[0])


def hash_ids(token_lists: list[list[int]], hash_block_tokens: int) -> list[tuple[int, ...]]:
    """Each prompt's chain ids: block i's id names its tokens and block i-1's id, numbered in first-seen order."""
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    chains = []
    for tokens in token_lists:
        parent, chain = -1, []
        for start in range(0, len(tokens), hash_block_tokens):
            parent = ids.setdefault((parent, tuple(tokens[start:start + hash_block_tokens])), len(ids))
            chain.append(parent)
        chains.append(tuple(chain))
    return chains


def scenario_trace(mix: SessionMix, encode: Callable[[list[dict]], list[int]], hash_block_tokens: int = 16,
                   output_tokens: tuple[int, int] = (16, 256)) -> list[TraceRequest]:
    """The trace: `encode` renders and tokenizes one request's messages (the model's chat template); output lengths
    are drawn uniformly from `output_tokens`."""
    arrivals = schedule(mix)
    token_lists = [encode(messages) for _, _, messages in arrivals]
    rng = random.Random(mix.seed + 1)
    return [TraceRequest(round(at * 1000), len(tokens), rng.randint(*output_tokens), chain)
            for (at, _, _), tokens, chain in zip(arrivals, token_lists, hash_ids(token_lists, hash_block_tokens),
                                                 strict=True)]
