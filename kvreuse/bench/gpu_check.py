"""`python -m kvreuse.bench.gpu_check --device cuda|cpu --out DIR [--quick]`: the engine checked on a device, in one
run that fits a short lease on a GPU machine (scripts/gpu_check.sh) and, with `--device cpu --quick`, in CI.

Steps, each isolated (a failure is recorded with its traceback and the run goes on): the machine; the tokenizer;
models with random weights built by transformers (random_models.py; `--quick`: the tiny ones); per model, greedy
parity with HF in fp32 and bf16 (parity.py), prefix cache on == off and segment reuse at recompute_ratio 1.0 exact
(reuse_checks.py); without `--quick`, parity through the compiled decode step; then `kvreuse bench engine` and the
chat scenario (`kvreuse bench scenario chat`) on the bench model, each in a process of its own. The report is
`DIR/gpu_check.json` and `.md`, rewritten after every step; the exit code is 1 if any step did not pass.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from kvreuse.bench import random_models
from kvreuse.bench.check_steps import CheckRun

# What each mode runs by default; every value has its flag. Full: for one H200, bounded by budget_s.
DEFAULTS = {
    "full": {"parity_tokens": 32, "reuse_tokens": 16, "engine_repeats": 3, "prefill_lengths": [512, 2048],
             "decode_prompt_len": 128, "decode_tokens": 64, "decode_batches": [1, 64],
             "engine_systems": ["kvreuse-bf16", "kvreuse-bf16-eager", "hf-bf16"], "scenario_requests": 16,
             "scenario_max_tokens": 16, "scenario_dtype": "bf16", "compile": "decode", "budget_s": 300.0,
             "engine_timeout_s": 130.0, "scenario_timeout_s": 80.0},
    "quick": {"parity_tokens": 8, "reuse_tokens": 4, "engine_repeats": 1, "prefill_lengths": [64],
              "decode_prompt_len": 16, "decode_tokens": 4, "decode_batches": [1, 2],
              "engine_systems": ["kvreuse-fp32-eager", "hf-fp32"], "scenario_requests": 2, "scenario_max_tokens": 2,
              "scenario_dtype": "fp32", "compile": "off", "budget_s": 240.0, "engine_timeout_s": 120.0,
              "scenario_timeout_s": 120.0},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvreuse.bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--out", type=Path, required=True, help="where gpu_check.json and gpu_check.md go")
    parser.add_argument("--quick", action="store_true", help="tiny models and small benches (CI's mode)")
    parser.add_argument("--work", type=Path, help="models and bench outputs (default: a temporary directory)")
    parser.add_argument("--tokenizer", type=Path, help="a Hugging Face tokenizer directory for the models "
                                                       "(default: the embedded model's, exported)")
    parser.add_argument("--architectures", nargs="+", help="HF model types to build (default: every one in "
                                                           "random_models.RANDOM_MODELS)")
    parser.add_argument("--models", nargs="+", help="models of that table to build, by name (default: all; "
                                                    "--quick: the tiny ones)")
    for key, value in DEFAULTS["full"].items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, list):
            parser.add_argument(flag, nargs="+", type=type(value[0]))
        else:
            parser.add_argument(flag, type=type(value))
    args = parser.parse_args(argv)
    for key, value in DEFAULTS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.selected = random_models.select(args.architectures, args.models, tiny_only=args.quick)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def prepare_tokenizer(given: Path | None, work: Path) -> dict:
    """The tokenizer directory the models get: `given`, or the embedded model's exported into `work`/tokenizer."""
    if given is not None:
        if not (given / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{given} holds no tokenizer.json (scripts/gpu_carry.sh exports one)")
        return {"path": str(given)}
    from kvreuse.weights.loader import load_model_info
    from kvreuse.weights.tokenizer import Tokenizer

    info = load_model_info(None)  # what `kvreuse tokenizer export` reads: metadata, no weights
    Tokenizer.load(info.path, info.fingerprint).export(work / "tokenizer", model_max_length=8192)
    return {"path": str(work / "tokenizer"), "exported_from": str(info.path)}


def engine_args(args: argparse.Namespace, model_dir: Path) -> list[str]:
    """`kvreuse bench engine` on `model_dir` with this run's sizes."""
    return ["--model", str(model_dir), "--device", args.device, "--repeats", str(args.engine_repeats),
            "--systems", *args.engine_systems, "--prefill-lengths", *map(str, args.prefill_lengths),
            "--decode-batches", *map(str, args.decode_batches), "--decode-tokens", str(args.decode_tokens),
            "--decode-prompt-len", str(args.decode_prompt_len)]


def scenario_args(args: argparse.Namespace, model_dir: Path) -> list[str]:
    """`kvreuse bench scenario chat` on `model_dir`: every cache mode and the HF peers."""
    return ["chat", "--model", str(model_dir), "--device", args.device, "--dtype", args.scenario_dtype,
            "--requests", str(args.scenario_requests), "--max-tokens", str(args.scenario_max_tokens),
            "--set", f"engine.compile={args.compile}"]


def main(argv: list[str] | None = None) -> int:
    from kvreuse.bench import device_info

    args = parse_args(argv)
    _quiet_transformers()
    work = args.work or Path(tempfile.mkdtemp(prefix="kvreuse-gpu-check-"))
    command = " ".join(["python -m kvreuse.bench.gpu_check", *(sys.argv[1:] if argv is None else argv)])
    header = {"device": args.device, "mode": "quick" if args.quick else "full", "work": str(work), "command": command}
    run = CheckRun(args.out, "gpu_check", header, time.monotonic() + args.budget_s)
    machine = run.step("environment", lambda: device_info.describe(args.device))
    header.update(machine.details)
    print("\n".join(f"  {key}: {value}" for key, value in machine.details.items()), flush=True)
    tokenizer = run.step("tokenizer", lambda: prepare_tokenizer(args.tokenizer, work), needs=("environment",))
    models = args.selected
    for spec in models:
        run.step(f"build {spec.name}", lambda spec=spec: {"path": str(random_models.build(
            spec, work / "models", Path(tokenizer.details["path"])))}, needs=("tokenizer",))
    _model_checks(run, args, work, models)
    _benches(run, args, work, models)
    run.write()
    print("\n" + run.summary() + f"\n\nwrote {args.out / 'gpu_check.json'} and .md: {run.verdict()}", flush=True)
    return 1 if run.failed else 0


def _quiet_transformers() -> None:
    """No progress bars for loading and saving weights: the run's output is its steps. (Without transformers the
    steps that need it fail, each saying so.)"""
    try:
        from transformers.utils import logging
    except ImportError:
        return
    logging.disable_progress_bar()


def _model_checks(run: CheckRun, args: argparse.Namespace, work: Path, models: list) -> None:
    """Per model: parity in fp32 and bf16, prefix cache on == off, full recompute exact; then, without --quick, the
    bench model's parity through its compiled decode step."""
    from kvreuse.bench import parity, reuse_checks

    for spec in models:
        path, needs = str(work / "models" / spec.name), (f"build {spec.name}",)
        for dtype in ("fp32", "bf16"):
            run.step(f"parity {spec.name} {dtype}", lambda path=path, dtype=dtype: parity.greedy_parity(
                path, args.device, dtype, args.parity_tokens), needs=needs)
        run.step(f"prefix cache on == off {spec.name}", lambda path=path: reuse_checks.prefix_cache_parity(
            path, args.device, args.reuse_tokens), needs=needs)
        run.step(f"segment reuse exact {spec.name}", lambda path=path: reuse_checks.full_recompute_is_exact(
            path, args.device, args.reuse_tokens), needs=needs)
    bench = _bench_model(models)
    if args.compile != "off" and bench is not None:
        run.step(f"parity {bench.name} bf16 compiled", lambda: parity.greedy_parity(
            str(work / "models" / bench.name), args.device, "bf16", args.parity_tokens, compile=args.compile,
            compile_timeout_s=max(1.0, run.remaining() or 300.0)), needs=(f"build {bench.name}",))


def _bench_model(models: list) -> random_models.RandomModel | None:
    """The model the benches run: the table's bench model when built, else the first one."""
    return next((m for m in models if m.bench), models[0] if models else None)


def _benches(run: CheckRun, args: argparse.Namespace, work: Path, models: list) -> None:
    from kvreuse.bench.bench_process import run_bench

    bench = _bench_model(models)
    if bench is None:
        return
    path, needs = work / "models" / bench.name, (f"build {bench.name}",)
    run.step(f"bench engine {bench.name}", lambda: run_bench(
        "engine", engine_args(args, path), work / "engine", min(args.engine_timeout_s, run.remaining())),
        needs=needs)
    run.step(f"bench scenario chat {bench.name}", lambda: run_bench(
        "scenario", scenario_args(args, path), work / "scenario", min(args.scenario_timeout_s, run.remaining())),
        needs=needs)


if __name__ == "__main__":
    sys.exit(main())
