"""The GPU check (scripts/gpu_check.sh) in its CPU mode, run as the script runs it, so that it cannot rot where no
GPU is lent; and its steps' isolation: a failure is recorded, said plainly, and the run goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvreuse.bench.check_steps import CheckFailed, CheckRun

from .server_process import REPO_ROOT

TINY = ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny", "gemma3-tiny", "phi3-tiny"]  # one per architecture
QUICK_STEPS = ["environment", "tokenizer", *(f"build {m}" for m in TINY),
               *(step for m in TINY for step in (f"parity {m} fp32", f"parity {m} bf16", f"prefix cache on == off {m}",
                                                  f"segment reuse exact {m}")),
               "bench engine llama-tiny", "bench scenario chat llama-tiny"]


def test_the_cpu_mode_passes_every_step(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "kvreuse.bench.gpu_check", "--device", "cpu", "--quick", "--out", str(out),
               "--work", str(tmp_path / "work")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert [s["name"] for s in report["steps"]] == QUICK_STEPS
    assert report["passed"] and [s["status"] for s in report["steps"]] == ["passed"] * len(QUICK_STEPS)
    steps = {s["name"]: s for s in report["steps"]}
    assert all(p["equal"] for m in TINY for p in steps[f"parity {m} fp32"]["details"]["prompts"])
    engine = steps["bench engine llama-tiny"]["details"]["report"]
    assert set(engine["medians"]) == {"kvreuse-fp32-eager", "hf-fp32"}
    assert all(v for row in engine["medians"].values() for v in row.values())
    scenario = steps["bench scenario chat llama-tiny"]["details"]["report"]["scenarios"]["chat"]
    assert {"no-cache", "prefix", "hf", "hf-prefix"} <= set(scenario)
    assert (out / "gpu_check.md").read_text().startswith("# gpu_check: every step passed")
    assert "every step passed" in done.stdout.splitlines()[-1]


def test_a_failed_step_is_recorded_and_the_run_goes_on(tmp_path):
    run = CheckRun(tmp_path, "check", {"device": "cpu"}, echo=lambda line: None)

    def broken() -> dict:
        raise ValueError("the model would not load")

    def unequal() -> dict:
        raise CheckFailed("greedy tokens differ", {"first_divergence": 3})

    run.step("fine", lambda: {"x": 1})
    run.step("broken", broken)
    run.step("after broken", lambda: {}, needs=("broken",))
    run.step("unequal", unequal)
    run.step("last", lambda: ({}, "| a table |"))
    report = json.loads((tmp_path / "check.json").read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [
        ("fine", "passed"), ("broken", "failed"), ("after broken", "skipped"), ("unequal", "failed"),
        ("last", "passed")]
    assert report["failed_steps"] == ["broken", "after broken", "unequal"] and not report["passed"]
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["broken"]["error"] == "ValueError: the model would not load"
    assert "Traceback" in steps["broken"]["traceback"]
    assert steps["unequal"]["details"] == {"first_divergence": 3}
    assert steps["after broken"]["error"] == "needs broken, which did not pass"
    markdown = (tmp_path / "check.md").read_text()
    assert markdown.startswith("# check: FAILED: broken, after broken, unequal")
    assert "| unequal | failed |" in markdown and "| a table |" in markdown


def test_steps_past_the_deadline_are_skipped(tmp_path):
    run = CheckRun(tmp_path, "check", {}, deadline=0.0, echo=lambda line: None)
    assert run.step("late", lambda: {}).error == "out of time (--budget-s)"


def test_a_bench_that_fails_is_a_failed_step_with_its_log(tmp_path):
    from kvreuse.bench.bench_process import run_bench

    with pytest.raises(CheckFailed, match=r"`kvreuse bench engine` failed \(exit 2\)") as failed:
        run_bench("engine", ["--systems", "kvreuse-fp64"], tmp_path, timeout_s=120)
    assert "unknown system 'kvreuse-fp64'" in failed.value.details["log_tail"]
