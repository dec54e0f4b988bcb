"""The agent bench's report: per-step rows and totals from step records, repeated runs of a system folded into one
result (medians), job-time ratios, the machine, and the markdown tables and TTFT-per-step plot.

Units are in the names: `_s` seconds, `_ms` milliseconds, `_tokens` token counts (sums over the records a row
covers), `_share` and `_per_new` ratios.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
from dataclasses import asdict
from pathlib import Path

TTFT_PNG = "agent_ttft.png"
REPLAY_TTFT_PNG = "agent-replay_ttft.png"
SIMD_FLAGS = re.compile(r"^(sse4_2|avx|avx2|avx512\w*|avx_vnni|fma|f16c|amx\w*)$")  # what decides llama.cpp's kernels


def _sum(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _counted(records: list) -> list:
    """The records whose prompt counts are usable for token ratios (a step that failed in transport has none)."""
    return [r for r in records if r.prompt_tokens is not None and r.new_tokens is not None]


def per_step(records: list, steps: int) -> list[dict]:
    """Per step index 1..`steps` over `records` (StepRecords, of one run or several): answered steps, median TTFT and
    latency (ms), token sums, the cached share of the prompt tokens and computed prompt tokens per new token."""
    rows = []
    for step in range(1, steps + 1):
        answered = [r for r in records if r.step == step and r.prompt_tokens is not None]
        counted = _counted(answered)
        prompt, cached = _sum([r.prompt_tokens for r in answered]), _sum([r.cached_tokens for r in answered])
        computed, new = _sum([r.computed_tokens for r in counted]), _sum([r.new_tokens for r in counted])
        rows.append({"step": step, "answered": len(answered),
                     "median_ttft_ms": _median([r.ttft_s * 1000 for r in answered]),
                     "median_latency_ms": _median([r.latency_s * 1000 for r in answered]),
                     "prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": computed,
                     "new_tokens": new, "completion_tokens": _sum([r.completion_tokens for r in answered]),
                     "cached_share": _ratio(cached, prompt), "computed_per_new": _ratio(computed, new)})
    return rows


def totals(records: list, wall_s: float) -> dict:
    """The job completion time and the token totals; `later_computed_per_new` is over steps 2 and later."""
    answered = [r for r in records if r.prompt_tokens is not None]
    later = [r for r in _counted(answered) if r.step > 1]
    prompt, computed = _sum([r.prompt_tokens for r in answered]), _sum([r.computed_tokens for r in answered])
    return {"job_completion_s": wall_s, "steps_answered": len([r for r in records if not r.error]),
            "steps_failed": len([r for r in records if r.error]),
            "prompt_tokens": prompt, "computed_tokens": computed, "computed_share": _ratio(computed, prompt),
            "completion_tokens": _sum([r.completion_tokens for r in answered]),
            "later_computed_per_new": _ratio(_sum([r.computed_tokens for r in later]),
                                             _sum([r.new_tokens for r in later]))}


def fold_runs(runs: list[dict], steps: int) -> dict:
    """One system's result over its repeated runs (each: url, model, records as StepRecords, wall_s): per-step rows
    and totals over all runs' records, with the job completion time the median of the runs' and each run's kept."""
    records = [r for run in runs for r in run["records"]]
    folded = totals(records, _median([run["wall_s"] for run in runs]))
    errors = [r.error for r in records if r.error]
    return {"url": runs[-1]["url"], "model": runs[-1]["model"], "runs": len(runs),
            "job_completion_runs_s": [run["wall_s"] for run in runs],
            "per_step": per_step(records, steps), "totals": folded,
            "computed_from": sorted({r.computed_from for r in records if r.computed_from}),
            "first_error": errors[0] if errors else None,
            "records": [{"run": i + 1, **asdict(r)} for i, run in enumerate(runs) for r in run["records"]]}


def job_ratios(systems: dict[str, dict], reference: str) -> dict[str, float]:
    """Job completion time of `reference` over each other system's ("kvreuse/llama-server": 0.5 is twice as fast)."""
    ours = systems[reference]["totals"]["job_completion_s"]
    return {f"{reference}/{name}": ours / result["totals"]["job_completion_s"]
            for name, result in systems.items() if name != reference}


def round_ratios(systems: dict[str, dict], reference: str) -> dict[str, list[float]]:
    """Per round (the i-th run of each system, run back to back), `reference`'s job time over each other's."""
    ours = systems[reference].get("job_completion_runs_s", [])
    # A system that failed is not tried again, so its i-th run, while there is one, is of round i.
    return {f"{reference}/{name}": [a / b for a, b in zip(ours, result.get("job_completion_runs_s", []), strict=False)]
            for name, result in systems.items() if name != reference}


def machine() -> dict:
    """The client machine: CPU model (lscpu's), its SIMD flags, cores, and the hypervisor if any."""
    from kvreuse.tuning.dtype_probe import cpu_identity

    info = {**cpu_identity(), "cores": os.cpu_count()}
    try:
        flags = next(line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
        info["simd_flags"] = sorted(f for f in flags if SIMD_FLAGS.match(f))
    except (OSError, StopIteration):
        info["simd_flags"] = []
    if shutil.which("lscpu"):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        for key, name in (("Model name", "lscpu_model"), ("Hypervisor vendor", "hypervisor")):
            if key in fields:
                info[name] = fields[key].strip()
    return info


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mean(total: int | None, count: int) -> float | None:
    return None if total is None or not count else total / count


def markdown(report: dict) -> str:
    """The per-step table (token columns as means per answered step), the totals table, the job-time ratios, where
    each number comes from, and the machine."""
    lines = ["| system | step | answered | median TTFT ms | median latency ms | mean prompt | mean new | "
             "mean computed | mean completion | cached share | computed/new |", "|---" * 11 + "|"]
    for name, result in report["systems"].items():
        for row in result["per_step"]:
            n = row["answered"]
            lines.append(f"| {name} | {row['step']} | {n} | {_fmt(row['median_ttft_ms'], '.0f')} | "
                         f"{_fmt(row['median_latency_ms'], '.0f')} | {_fmt(_mean(row['prompt_tokens'], n), '.0f')} "
                         f"| {_fmt(_mean(row['new_tokens'], n), '.0f')} | "
                         f"{_fmt(_mean(row['computed_tokens'], n), '.0f')} | "
                         f"{_fmt(_mean(row.get('completion_tokens'), n), '.0f')} | "
                         f"{_fmt(row['cached_share'], '.1%')} | {_fmt(row['computed_per_new'], '.2f')} |")
    lines += ["", "| system | runs | job completion s (median) | each run s | steps answered | steps failed | "
                  "computed/prompt | steps 2+ computed/new |", "|---" * 8 + "|"]
    for name, result in report["systems"].items():
        t = result["totals"]
        each = ", ".join(f"{s:.2f}" for s in result.get("job_completion_runs_s", [t["job_completion_s"]]))
        lines.append(f"| {name} | {result.get('runs', 1)} | {t['job_completion_s']:.2f} | {each} | "
                     f"{t['steps_answered']} | {t['steps_failed']} | {_fmt(t['computed_share'], '.1%')} | "
                     f"{_fmt(t['later_computed_per_new'], '.2f')} |")
    o, m = report["options"], report["machine"]
    lines += ["", f"{o['sessions']} sessions x {o['steps']} steps; calls up to {o['call_tokens']} tokens, final "
                  f"answer {o['answer_tokens']} tokens; tool latency {o['tool_latency_s']} s, results ~"
                  f"{o['tool_result_tokens']} tokens; seed {o['seed']}."]
    if report.get("mode") == "replay":
        source = report["transcript"].get("source") or {}
        lines.append(f"Replay of the conversations recorded against {source.get('system', 'a server')}: each step "
                     "sends the recorded messages (call turns as that server returned them) with tool_choice none, "
                     "ignore_eos and max_tokens = the recorded completion length; a step's new tokens are its prompt "
                     "minus the previous prompt (the echoed call turn is new to a server that wrote other text).")
    for pair, value in report["ratios"].items():
        rounds = report.get("round_ratios", {}).get(pair, [])
        each = f" (per round: {', '.join(f'{r:.2f}' for r in rounds)})" if len(rounds) > 1 else ""
        lines.append(f"Job completion time {pair}: {value:.2f}x{each}.")
    sources = [f"{name}: {', '.join(r['computed_from'])}" for name, r in report["systems"].items()
               if r.get("computed_from")]
    if sources:
        lines.append(f"Computed prompt tokens from {'; '.join(sources)}.")
    errors = [f"{name}: {r['first_error']}" for name, r in report["systems"].items() if r["first_error"]]
    lines += [f"First failure, {e}" for e in errors]
    lines += [f"{name} did not run: {why}" for name, why in report.get("failures", {}).items()]
    flags = m.get("simd_flags") or m["flags"]
    lines.append(f"Client CPU: {m.get('lscpu_model') or m['cpu']} ({', '.join(flags) or 'no flags'}), {m['cores']} "
                 f"cores{', under ' + m['hypervisor'] if m.get('hypervisor') else ''}.")
    return "\n".join(lines)


def ttft_plot(report: dict, path) -> Path:
    """Median TTFT (ms) per step, one line per system. Returns the PNG's path."""
    from kvreuse.bench.plots import Figure, _colour, _save  # the bench extra

    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, result) in enumerate(report["systems"].items()):
        points = [(row["step"], row["median_ttft_ms"]) for row in result["per_step"] if row["median_ttft_ms"]]
        ax.plot([s for s, _ in points], [t for _, t in points], marker="o", color=_colour(i), label=name)
    o = report["options"]
    ax.set_xticks(range(1, o["steps"] + 1))
    ax.set_xlabel("agent step (the last one is the final answer)")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_title(f"TTFT per agent step\n{o['sessions']} sessions x {o['steps']} steps, tool results ~"
                 f"{o['tool_result_tokens']} tokens")
    ax.legend(title="system", fontsize="small")
    return _save(fig, path)
