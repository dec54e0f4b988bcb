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


EVAL_RUBRIC = """You are grading a short answer written by a student. Read the answer above carefully, then
apply this rubric.

Criteria, each scored from 0 to 5:
1. Correctness: are the facts and the reasoning right? Deduct for any claim that is false or unsupported.
2. Completeness: does the answer address every part of the question, including edge cases it raises?
3. Clarity: is it well organised, with short sentences, defined terms and no needless repetition?
4. Concision: does it avoid padding, filler and digressions that do not serve the question?
5. Evidence: does it cite the relevant function, rule or example when one is needed?

Scoring rules: start each criterion at 5 and deduct one point per distinct problem, never below 0. Do not
reward length for its own sake. Do not penalise informal tone if the content is right. If the answer is
empty or off-topic, every criterion scores 0. If the answer copies the question without answering it,
score Completeness and Evidence 0.

Output format: first a line with the five scores separated by commas, then one sentence of feedback for
the student naming the single most important improvement. Do not output anything else."""

EVAL_ANSWERS = [
    "A heap keeps the smallest item at index 0, so popping it is cheap.",
    "JSON is a text format; json.loads turns a string into Python objects and json.dumps does the reverse.",
    "csv.reader splits each line on commas, but quoted fields may contain commas too.",
    "The median is the middle value, the mean is the average; outliers move the mean more.",
    "A temporary file is deleted when closed, which keeps the disk clean.",
    "shelve stores pickled objects in a dbm file, keyed by strings.",
    "fnmatch matches file names against shell-style patterns like *.txt.",
    "uuid4 makes random identifiers; uuid1 uses the clock and the MAC address.",
]


def batch_eval(num_requests: int = 24, seed: int = 0) -> list[list[dict]]:
    """A short varying answer followed by a long fixed judging rubric: the shared text sits at the tail,
    after text of varying length, so it is never a prefix and rarely on the same block grid."""
    rng = random.Random(seed)
    conversations = []
    for i in range(num_requests):
        answer = rng.choice(EVAL_ANSWERS)
        conversations.append([{"role": "user", "content": f"Student answer #{i + 1}:\n{answer}\n\n{EVAL_RUBRIC}"}])
    return conversations


WORKLOADS = {"rag": rag, "eval": batch_eval}
