"""Deterministic workloads over a small corpus shipped in the repo (no downloads).

Each workload is a list of chat conversations, in the order they are sent; the shared text is the
larger part of each prompt, placed as the article's scenarios (chat, eval, agent, RAG) place it.
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


def rag_corpus(num_docs: int = 6, seed: int = 0) -> list[list[dict]]:
    """The documents `rag(num_docs=, seed=)` draws its queries from, as a deployment would warm them: each as the
    first document of a query under the RAG system prompt, so a query that starts with it hits that prefix exactly,
    and segment reuse finds its blocks wherever else it lands."""
    pool = random.Random(seed).sample(documents(), min(num_docs, len(documents())))  # rag()'s first draw
    return [[{"role": "system", "content": RAG_SYSTEM},
             {"role": "user", "content": f"Documents:\n\n[1] {d['title']}\n{d['text']}"}] for d in pool]


def rag(num_requests: int = 24, docs_per_query: tuple[int, int] = (2, 3), num_docs: int = 6,
        seed: int = 0) -> list[list[dict]]:
    """Each query retrieves 2-3 documents from a pool of `num_docs` (the hot set of a knowledge base) in a
    random order, so the same document lands at different positions (and block grids) across requests."""
    rng = random.Random(seed)
    pool = rng.sample(documents(), min(num_docs, len(documents())))
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


CHAT_SYSTEM = """You are a helpful assistant for software developers, working inside a team's documentation tool.

Guidelines:
- Explain clearly and give examples. Prefer a short runnable example over a long description.
- When a question is ambiguous, state the assumption you make in one sentence, then answer.
- Use the terminology of the module being discussed, and name functions and classes exactly.
- When you are not sure that an API exists, say so instead of guessing its signature.
- Point out common mistakes and edge cases: empty inputs, encodings, time zones, large files.
- Keep answers focused: no greetings, no apologies, no repetition of the question.
- Follow-up requests such as "continue" or "more detail" refer to your previous answer; build on it
  instead of starting over.
- Never include secrets, tokens or personal data in examples; use placeholders such as EXAMPLE_KEY.
- Code blocks name their language. Shell commands show the prompt-free command only.

Tone: friendly, precise and direct, as a senior colleague reviewing a pull request would be."""
CHAT_FOLLOW_UPS = ["Can you go into more detail?", "Continue.", "Give me another example.", "Explain that more simply."]
CHAT_TAIL = "Answer in markdown only."


def chat(num_requests: int = 24, turns: int = 8, seed: int = 0) -> list[list[dict]]:
    """Multi-turn chats under one fixed system prompt, one request per turn: each turn resends the whole
    conversation (so it extends the previous request of its conversation), follow-ups such as "Continue.",
    and a fixed tail instruction on every user message. Assistant turns hold canned text from the corpus;
    the benchmarks send the reply the model actually gave instead (`LiveReplies`)."""
    rng = random.Random(seed)
    pool = documents()
    requests = []
    while len(requests) < num_requests:
        doc = rng.choice(pool)
        messages = [{"role": "system", "content": CHAT_SYSTEM},
                    {"role": "user", "content": f"What does the {doc['title']} do? {CHAT_TAIL}"}]
        paragraphs = doc["text"].split("\n\n")
        for turn in range(turns):
            requests.append([dict(m) for m in messages])
            reply = paragraphs[turn % len(paragraphs)]
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"{rng.choice(CHAT_FOLLOW_UPS)} {CHAT_TAIL}"}]
    return requests[:num_requests]


def document_chat(num_requests: int = 24, turns: int = 4, docs_per_session: int = 2,
                  seed: int = 0) -> list[list[dict]]:
    """Multi-turn chats about documents: each session opens with its own documents (a few hundred tokens that no
    other session shares) and a question, then follow-ups, one request per turn, sessions listed one after another.
    Unlike `chat`, whose fixed system prompt is most of every prompt, what a turn can reuse is mostly its own
    session's: the workload where sending a session's turns to the replica that holds them matters."""
    rng = random.Random(seed)
    pool = documents()
    requests = []
    while len(requests) < num_requests:
        picked = rng.sample(pool, docs_per_session)
        body = "\n\n".join(f"{d['title']}\n{d['text']}" for d in picked)
        messages = [{"role": "system", "content": CHAT_SYSTEM},
                    {"role": "user", "content": f"Read these documents:\n\n{body}\n\nWhat do they have in common? "
                                                f"{CHAT_TAIL}"}]
        for _ in range(turns):
            requests.append([dict(m) for m in messages])
            messages += [{"role": "assistant", "content": rng.choice(picked)["text"][:200]},
                         {"role": "user", "content": f"{rng.choice(CHAT_FOLLOW_UPS)} {CHAT_TAIL}"}]
    return requests[:num_requests]


class LiveReplies:
    """Multi-turn replay as `vllm`'s multi-turn benchmark does it: an assistant turn is sent as the reply the
    model gave to the request that ended just before it, so each turn resends what was generated (and a
    cache that keeps generated tokens can hit on it). Turns whose reply is not known yet (a request still in
    flight, or none recorded) keep the workload's canned text. Requests without assistant turns pass as they
    are."""

    def __init__(self):
        self._replies: dict[str, str] = {}  # the workload's messages up to an assistant turn -> the reply given

    @staticmethod
    def _key(messages: list[dict]) -> str:
        return json.dumps(messages, sort_keys=True, ensure_ascii=False)

    def fill(self, messages: list[dict]) -> list[dict]:
        """`messages` with every assistant turn replaced by the recorded reply to the turns before it."""
        return [{**m, "content": self._replies.get(self._key(messages[:i]), m["content"])}
                if m["role"] == "assistant" else m for i, m in enumerate(messages)]

    def record(self, messages: list[dict], reply: str) -> None:
        """The model answered the workload request `messages` (as given, before `fill`) with `reply`."""
        self._replies[self._key(messages)] = reply


AGENT_TOOLS = """Available tools:
- search(query: str) -> list of {title, url, snippet}: web search; use for facts you do not know.
- read_file(path: str) -> str: the contents of a file in the workspace.
- write_file(path: str, content: str) -> None: create or replace a file in the workspace.
- run(command: str) -> {exit_code, stdout, stderr}: run a shell command in the workspace, 60 s limit.
- ask_user(question: str) -> str: ask the user when the task is ambiguous; use sparingly.

Output rules:
1. Think step by step, but output only one action per turn.
2. An action is a JSON object {"tool": name, "args": {...}} on a single line, with nothing after it.
3. When the task is done, output {"tool": "finish", "args": {"summary": "..."}} instead.
4. Never invent tool results; wait for them.
5. Keep file edits minimal and explain nothing outside the JSON."""

AGENT_TASKS = ["Fix the failing test in tests/test_io.py.", "Add a --verbose flag to the CLI.",
               "Find out which Python version the project needs.", "Rename the function load to read_config."]


def agent(num_requests: int = 24, seed: int = 0) -> list[list[dict]]:
    """Agent steps: a task, the latest tool result (variable length and content), then the long fixed tool
    descriptions and output rules at the tail, where they are never a prefix."""
    rng = random.Random(seed)
    pool = documents()
    requests = []
    for step in range(num_requests):
        result = {"exit_code": rng.choice([0, 1]), "stdout": rng.choice(pool)["text"][: rng.randint(80, 400)]}
        content = (f"Task: {rng.choice(AGENT_TASKS)}\nStep {step + 1}. Last tool result:\n"
                   f"{json.dumps(result)}\n\n{AGENT_TOOLS}")
        requests.append([{"role": "user", "content": content}])
    return requests


def prefix_repetition(num_requests: int = 24, num_prefixes: int = 4, prefix_words: int = 300,
                      suffix_words: int = 40, seed: int = 0) -> list[str]:
    """vLLM's prefix_repetition shape: each prompt is one of `num_prefixes` long random prefixes followed by
    a random suffix (plain prompts, no chat template)."""
    rng = random.Random(seed)
    words = " ".join(d["text"] for d in documents()).split()
    sample = lambda n: " ".join(rng.choice(words) for _ in range(n))
    prefixes = [sample(prefix_words) for _ in range(num_prefixes)]
    return [f"{rng.choice(prefixes)}\n{sample(suffix_words)}" for _ in range(num_requests)]


def generated_shared_prefix(num_groups: int = 4, prompts_per_group: int = 6, seed: int = 0) -> list[list[dict]]:
    """SGLang's generated-shared-prefix shape: groups of requests sharing a long system prompt, each with its
    own short question."""
    rng = random.Random(seed)
    pool = documents()
    requests = []
    for group in range(num_groups):
        system = f"Reference {group}:\n" + "\n\n".join(d["text"] for d in rng.sample(pool, 2))
        requests += [[{"role": "system", "content": system},
                      {"role": "user", "content": rng.choice(RAG_QUESTIONS).format(index=1, title="it")}]
                     for _ in range(prompts_per_group)]
    return requests


def shared_prefix(num_requests: int = 24, prompts_per_group: int = 6, seed: int = 0) -> list[list[dict]]:
    """`generated_shared_prefix` cut to `num_requests` requests: the scenario bench's "prefix" scenario."""
    num_groups = -(-num_requests // prompts_per_group)
    return generated_shared_prefix(num_groups, prompts_per_group, seed)[:num_requests]


# The scenarios of `kvreuse bench scenario`, in report order.
WORKLOADS = {"chat": chat, "eval": batch_eval, "agent": agent, "rag": rag, "prefix": shared_prefix}
