"""Deterministic workloads over a small corpus shipped in the repo (no downloads).

Each workload is a list of chat conversations, in the order they are sent; the shared text is the
larger part of each prompt, placed as the seed's scenarios place it.
"""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path

CORPUS = Path(__file__).parent / "data" / "corpus.json"

RAG_SYSTEM = "You answer questions using only the documents provided by the user. Be brief."
RAG_QUESTIONS = [
    "Which document is about {title}? Answer with its number.",
    "Summarise document [{index}] in one sentence.",
    "What is the main purpose described in document [{index}]?",
    "Name one function or class mentioned in document [{index}].",
]


@cache
def documents() -> list[dict]:
    return json.loads(CORPUS.read_text(encoding="utf-8"))["documents"]


def rag(num_requests: int = 24, docs_per_query: tuple[int, int] = (2, 3), seed: int = 0) -> list[list[dict]]:
    """Each query retrieves 2-3 documents from the pool in a random order, so the same document lands at
    different positions (and on different block grids) across requests."""
    rng = random.Random(seed)
    pool = documents()
    conversations = []
    for _ in range(num_requests):
        picked = rng.sample(pool, rng.randint(*docs_per_query))
        body = "\n\n".join(f"[{i + 1}] {d['title']}\n{d['text']}" for i, d in enumerate(picked))
        index = rng.randrange(len(picked))
        question = rng.choice(RAG_QUESTIONS).format(index=index + 1, title=picked[index]["title"].split()[-1])
        conversations.append([{"role": "system", "content": RAG_SYSTEM},
                              {"role": "user", "content": f"Documents:\n\n{body}\n\nQuestion: {question}"}])
    return conversations
