"""A check made of isolated steps: each step runs whatever happened before it, a failure is recorded with its
traceback and the run goes on, and the report (JSON and Markdown) is rewritten after every step, so a run cut off by
its time limit still leaves what it found."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

MARKS = {"passed": " ok ", "failed": "FAIL", "skipped": "skip"}


class CheckFailed(Exception):
    """A step ran and its check did not hold: `message` says what, `details` what was measured."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details or {}


@dataclass
class StepResult:
    name: str
    status: str                 # passed, failed or skipped
    seconds: float
    details: dict = field(default_factory=dict)
    error: str | None = None    # one line: why it failed or was skipped
    traceback: str | None = None
    table: str | None = None    # Markdown the step produced (a bench's table)


class CheckRun:
    """Steps run in order by `step`; the report is written to `out`/<name>.json and .md after each one. Steps past
    `deadline` (time.monotonic) are skipped, as are steps whose `needs` did not pass."""

    def __init__(self, out: Path, name: str, header: dict, deadline: float | None = None,
                 echo: Callable[[str], None] = print):
        self.out, self.name, self.header, self.deadline, self.echo = out, name, header, deadline, echo
        self.results: dict[str, StepResult] = {}

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def step(self, name: str, fn: Callable[[], dict | tuple[dict, str]], needs: tuple[str, ...] = ()) -> StepResult:
        """Run `fn`, which returns its details (or details and a Markdown table) and raises CheckFailed when its check
        does not hold; any other exception fails the step too, with its traceback."""
        missing = [n for n in needs if n not in self.results or self.results[n].status != "passed"]
        remaining = self.remaining()
        if missing:
            result = StepResult(name, "skipped", 0.0, error=f"needs {', '.join(missing)}, which did not pass")
        elif remaining is not None and remaining <= 0:
            result = StepResult(name, "skipped", 0.0, error="out of time (--budget-s)")
        else:
            result = self._run(name, fn)
        self.results[name] = result
        self.echo(f"[{MARKS[result.status]}] {name} ({result.seconds:.1f} s)"
                  + (f": {result.error}" if result.error else ""))
        self.write()
        return result

    def _run(self, name: str, fn: Callable) -> StepResult:
        start = time.perf_counter()
        try:
            value = fn()
        except CheckFailed as exc:
            return StepResult(name, "failed", time.perf_counter() - start, exc.details, str(exc),
                              traceback.format_exc())
        except Exception as exc:  # any error is this step's failure, and the run goes on
            last = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            return StepResult(name, "failed", time.perf_counter() - start, error=last,
                              traceback=traceback.format_exc())
        details, table = value if isinstance(value, tuple) else (value, None)
        return StepResult(name, "passed", time.perf_counter() - start, details or {}, table=table)

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results.values() if r.status != "passed"]

    def report(self) -> dict:
        return {**self.header, "passed": not self.failed, "failed_steps": self.failed,
                "steps": [asdict(r) for r in self.results.values()]}

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"{self.name}.json").write_text(json.dumps(self.report(), indent=2, default=str) + "\n")
        (self.out / f"{self.name}.md").write_text(self.markdown() + "\n")

    def markdown(self) -> str:
        """The verdict, the header, every step and what it produced, then each failure's traceback."""
        lines = [f"# {self.name}: {self.verdict()}", "", "| | |", "|---|---|"]
        lines += [f"| {key} | {value} |" for key, value in self.header.items() if not isinstance(value, dict)]
        lines += ["", self.summary()]
        for r in self.results.values():
            if r.traceback:
                lines += ["", f"## {r.name}: {r.status}", "", "```", r.traceback.rstrip(), "```"]
        return "\n".join(lines)

    def verdict(self) -> str:
        return "every step passed" if not self.failed else f"FAILED: {', '.join(self.failed)}"

    def summary(self) -> str:
        """The steps' table and the tables they produced: what a terminal's last lines should show."""
        lines = ["| step | result | seconds | why |", "|---|---|---|---|"]
        lines += [f"| {r.name} | {r.status} | {r.seconds:.1f} | {r.error or ''} |" for r in self.results.values()]
        for r in self.results.values():
            if r.table:
                lines += ["", f"## {r.name}", "", r.table]
        return "\n".join(lines)
