"""Replaying an agent run: the same conversations sent to any server, step by step.

A live run (agent_loop) against one server records a `Transcript`: per session its tools and, per answered step,
the request's messages (the assistant's call turns exactly as that server returned them), its max_tokens and the
completion length it got. A replay sends each session's recorded step-k messages in order, sessions side by side,
after the same simulated tool latency, with `tool_choice: "none"`, `ignore_eos` and `max_tokens` = the recorded
completion length: every server reads the same prompts through its own chat template (the echoed call turns
re-rendered as a real client makes it) and writes answers of the recorded lengths, so a server that cannot produce
the calls itself (llama-server with a 135M model under a grammar that lets prose come first) is measured on the
same loop.

What a replayed step's new tokens are: its prompt minus the previous step's prompt. In a replay the server wrote
text of the recorded length, not the recorded call, so the echoed call turn is new to it, with the tool results
and the template's glue (in a live run the previous completion is not counted as new).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvreuse.bench.agent_loop import Options, StepRecord, account_new_tokens, timed_step, with_client

FORMAT = "kvreuse-agent-transcript/1"


@dataclass
class TranscriptStep:
    """One answered step as it was sent: its messages and max_tokens, and the completion length it got."""
    messages: list[dict]
    max_tokens: int
    completion_tokens: int | None = None
    final: bool = False

    def replay_tokens(self) -> int:
        """max_tokens of the replayed step: the recorded completion's length, else the recorded max_tokens."""
        return max(1, self.completion_tokens if self.completion_tokens is not None else self.max_tokens)


@dataclass
class SessionTranscript:
    index: int
    tools: list[dict]
    steps: list[TranscriptStep] = field(default_factory=list)


@dataclass
class Transcript:
    """A live run's conversations: the options it ran with, where it was recorded, and each session's steps."""
    options: dict
    source: dict = field(default_factory=dict)  # system, url, model of the recorded run
    sessions: list[SessionTranscript] = field(default_factory=list)

    def session(self, index: int, tools: list[dict]) -> SessionTranscript:
        """The transcript of session `index`, started with `tools` when it is new."""
        for session in self.sessions:
            if session.index == index:
                return session
        new = SessionTranscript(index, tools)
        self.sessions = sorted([*self.sessions, new], key=lambda s: s.index)
        return new

    def record(self, index: int, tools: list[dict], request: dict, completion_tokens: int | None) -> None:
        """Add an answered step of session `index` (`request`: the step's create() arguments)."""
        self.session(index, tools).steps.append(TranscriptStep(
            json.loads(json.dumps(request["messages"])), request["max_tokens"], completion_tokens,
            final=request.get("tool_choice") == "none"))

    def steps(self) -> int:
        return max((len(s.steps) for s in self.sessions), default=0)

    def summary(self) -> dict:
        return {"source": self.source, "sessions": len(self.sessions), "steps": self.steps(),
                "replayed_tokens": [[s.replay_tokens() for s in session.steps] for session in self.sessions]}

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> Transcript:
        """ValueError if `data` is no transcript."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not an agent transcript (format {FORMAT!r} expected)")
        try:
            sessions = [SessionTranscript(s["index"], s["tools"], [TranscriptStep(**step) for step in s["steps"]])
                        for s in data["sessions"]]
            return cls(dict(data["options"]), dict(data.get("source") or {}), sessions)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed agent transcript: {exc!r}") from exc

    def save(self, path: Path | str) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: Path | str) -> Transcript:
        """ValueError if the file cannot be read or holds no transcript."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the transcript {path}: {exc}") from exc
        return cls.from_json(data)

    def replay_options(self) -> Options:
        """The recorded run's options, steps set to the longest recorded session."""
        known = {k: v for k, v in self.options.items() if k in Options.__dataclass_fields__}
        return Options(**{**known, "sessions": len(self.sessions), "steps": self.steps()})


def replay_request(model: str, session: SessionTranscript, step: TranscriptStep, session_hints: bool = False) -> dict:
    """The create() arguments of one replayed step: the recorded messages and tools, no call asked for, an answer of
    the recorded length."""
    request = {"model": model, "messages": step.messages, "tools": session.tools, "tool_choice": "none",
               "temperature": 0, "max_tokens": step.replay_tokens(), "extra_body": {"ignore_eos": True}}
    if session_hints:
        request["prompt_cache_key"] = f"agent-session-{session.index}"
    return request


async def replay_session(client, model: str, session: SessionTranscript, options: Options) -> list[StepRecord]:
    """The session's recorded steps in order, each after the tool latency (as in the live loop); stops at the first
    step that fails."""
    records = []
    for number, step in enumerate(session.steps, start=1):
        if number > 1:
            await asyncio.sleep(options.tool_latency_s)
        record = StepRecord(session.index, number)
        records.append(record)
        if await timed_step(client, replay_request(model, session, step, options.session_hints), record) is None:
            break
    account_new_tokens(records, completion_reused=False)
    return records


async def replay_loop(url: str, transcript: Transcript, model: str | None,
                      api_key: str) -> tuple[str, list[StepRecord], float]:
    """All recorded sessions side by side against the server at `url`: (the model name sent, every step's record,
    the job's wall time in seconds)."""
    options = transcript.replay_options()

    async def sessions(client, name: str) -> list[list[StepRecord]]:
        return await asyncio.gather(*(replay_session(client, name, s, options) for s in transcript.sessions))

    return await with_client(url, model, api_key, sessions)
