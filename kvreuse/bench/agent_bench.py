"""`kvreuse bench agent`: an agent loop with real tool calls against OpenAI-compatible servers, compared.

N sessions run side by side, each for K steps of streamed, forced tool calls and a final answer
(agent_workload: the sessions and simulated tools; agent_loop: the steps; agent_stream: one streamed answer and
where its token counts come from). Each system (agent_systems: kvreuse with caching on and off and llama-server,
started by the bench, or servers given by URL) is run `repeats` times, interleaved (A B C A B C ...) and started
afresh for every run, so every run begins with an empty cache and a load that comes and goes touches every system
alike; agent_report folds the runs (medians) and writes the tables and the plot. A live run can record its
conversations as a transcript, and a replay (agent_replay) sends a recorded transcript to every system instead of
the live loop: the same conversations on any server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict

from kvreuse.bench.agent_loop import Options, run_loop
from kvreuse.bench.agent_replay import Transcript, replay_loop
from kvreuse.bench.agent_report import fold_runs, job_ratios, machine, round_ratios
from kvreuse.bench.agent_systems import System, reachable


def run_system(url: str, options: Options, model: str | None = None, api_key: str = "EMPTY",
               transcript: Transcript | None = None, replay: Transcript | None = None) -> dict:
    """One run of the agent loop against the server at `url` (its root, with or without /v1), or of the replay of
    `replay`: its url, the model name sent, every step's record (StepRecords) and the job's wall time in seconds;
    a live run's answered steps are added to `transcript` when one is given. RuntimeError if the server cannot be
    reached or no step succeeded."""
    if replay is not None:
        model, records, wall_s = asyncio.run(replay_loop(url, replay, model, api_key))
    else:
        model, records, wall_s = asyncio.run(run_loop(url, options, model, api_key, transcript))
    errors = [r.error for r in records if r.error]
    if len(errors) == len(records):
        raise RuntimeError(f"no agent step against {url} succeeded; first error: {errors[0]}")
    return {"url": url, "model": model, "records": records, "wall_s": wall_s}


def run(systems: list[System], options: Options, model: str | None = None, api_key: str = "EMPTY",
        progress: Callable[[str], None] = print, repeats: int = 1, transcript: Transcript | None = None,
        replay: Transcript | None = None) -> dict:
    """`repeats` rounds, each running every system once in order (a started server is stopped before the next
    starts), then the report: the options, the machine, each system's folded result, the systems that failed
    (`failures`: name -> why; a system that fails is not tried again), and the job-time ratios (of medians, and per
    round) of the first kvreuse system (else the first system) to the others. RuntimeError if every system failed.
    With `replay`, every run replays that transcript (its options replace `options`); else the first run (the first
    system's, round 1) records its conversations into `transcript` when one is given."""
    if replay is not None:
        options = replay.replay_options()
    runs: dict[str, list[dict]] = {}
    failures: dict[str, str] = {}
    for round_index in range(1, repeats + 1):
        for system in systems:
            if system.name in failures:
                continue
            try:
                recording = transcript if transcript is not None and not runs and replay is None else None
                runs.setdefault(system.name, []).append(_run_one(system, options, model, api_key, progress,
                                                                 f"round {round_index}/{repeats}", recording, replay))
                if recording is not None:
                    recording.source = {"system": system.name, "url": runs[system.name][-1]["url"],
                                        "model": runs[system.name][-1]["model"]}
            except RuntimeError as exc:  # reported beside the others: one peer that cannot run ends nothing
                failures[system.name] = str(exc)
                progress(f"{system.name} failed: {exc}")
    results = {name: fold_runs(done, options.steps) for name, done in runs.items() if done}
    if not results:
        raise RuntimeError("; ".join(f"{name}: {why}" for name, why in failures.items()))
    reference = next((name for name in results if name.startswith("kvreuse")), next(iter(results)))
    report = {"suite": "agent", "options": asdict(options), "repeats": repeats, "machine": machine(),
              "systems": results, "failures": failures, "reference": reference,
              "ratios": job_ratios(results, reference), "round_ratios": round_ratios(results, reference)}
    if replay is not None:
        report.update(mode="replay", transcript=replay.summary())
    return report


def _run_one(system: System, options: Options, model: str | None, api_key: str,
             progress: Callable[[str], None], label: str, transcript: Transcript | None = None,
             replay: Transcript | None = None) -> dict:
    with reachable(system, progress) as url:
        what = "replay of " if replay is not None else ""
        progress(f"{system.name} ({label}): {what}{options.sessions} sessions x {options.steps} steps at {url}")
        extra = {k: v for k, v in (("transcript", transcript), ("replay", replay)) if v is not None}
        result = run_system(url, options, model, api_key, **extra)
    failed = len([r for r in result["records"] if r.error])
    progress(f"{system.name} ({label}): job {result['wall_s']:.1f} s, {failed} steps failed")
    return result
