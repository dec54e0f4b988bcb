"""`kvreuse bench eval` (kvreuse/bench/eval_bench.py) in its smallest form, on the tiny model: lm-eval's requests
built as lm-eval builds them, the report's shape, cache-on computing less than cache-off, and the scores identical
across the three modes. Timings are not asserted (the machine is noisy)."""

from __future__ import annotations

import json

from kvreuse.bench import eval_bench
from kvreuse.cli import build_parser

QUESTIONS = 2
CONTEXT_TOKENS = 300  # the smallest the bench is about: its cost is the logits of every prompt position


def test_questions_are_tokenized_as_lm_eval_does(real_tokenizer):
    questions = eval_bench.make_questions(real_tokenizer, 3, context_tokens=400)
    assert len({q.requests[0][:16].__repr__() for q in questions}) == 3  # no first block shared across questions
    for q in questions:
        assert len(q.requests) == len(q.choices) == eval_bench.NUM_CHOICES and 0 <= q.gold < eval_bench.NUM_CHOICES
        assert 300 <= q.ctxlen <= 450
        context = real_tokenizer.decode(q.requests[0][:q.ctxlen])
        assert context.endswith(eval_bench.QUESTION_LINE)
        for ids, choice in zip(q.requests, q.choices, strict=True):
            assert ids[:q.ctxlen] == q.requests[0][:q.ctxlen]  # the context tokens, then the choice's
            assert 2 <= len(ids) - q.ctxlen <= 8
            assert real_tokenizer.decode(ids[q.ctxlen:]) == choice


def test_the_eval_bench_scores_alike_in_every_mode(tiny_model_dir):
    lines: list[str] = []
    report = eval_bench.run(num_questions=QUESTIONS, context_tokens=CONTEXT_TOKENS, repeats=1, progress=lines.append,
                            model_path=tiny_model_dir, kv_cache_memory_mb=16)
    assert report["suite"] == "eval" and report["questions"] == QUESTIONS and report["repeats"] == 1
    assert report["dtype"] == "fp32" and set(report["cpu"]) == {"cpu", "machine", "flags"}
    assert report["machine"]["torch_threads"] == 2 and len(lines) == 1
    assert report["context_tokens"]["min"] >= 300 and report["choices"] == 4
    modes = report["modes"]
    assert list(modes) == ["cache-on", "cache-off", "hf"]
    prompt_tokens = modes["hf"]["prompt_tokens"]
    for row in modes.values():
        assert row["prompt_tokens"] == prompt_tokens and len(row["round_totals_s"]) == 1 and row["total_s"] > 0
        assert len(row["samples_s"]) == QUESTIONS and all(len(per_round) == 1 for per_round in row["samples_s"])
    assert modes["hf"]["prefill_tokens"] == modes["cache-off"]["prefill_tokens"] == prompt_tokens
    assert modes["cache-off"]["cached_tokens"] == 0
    # Per question the first request computes the context; the other three reuse its full blocks but the last.
    assert modes["cache-on"]["cached_tokens"] > 0
    assert modes["cache-on"]["prefill_tokens"] + modes["cache-on"]["cached_tokens"] == prompt_tokens
    assert modes["cache-on"]["prefill_tokens"] < prompt_tokens / 2
    # The scores: the same predictions everywhere, cache-on and cache-off within float noise, HF close.
    assert report["predictions_match"] and report["hf_near_tie_flips"] == 0
    for key in ("predictions_acc", "predictions_acc_norm", "acc", "acc_norm"):
        assert modes["cache-on"][key] == modes["cache-off"][key] == modes["hf"][key]
    diffs = report["max_abs_score_diff"]
    assert diffs["cache-on vs cache-off"] < 1e-3 and diffs["cache-on vs hf"] < 1e-3
    speedup = report["speedup"]
    assert speedup["cache_on_vs_off"] > 0  # timings are not asserted; the verdict on them is
    assert speedup["met"] == (speedup["cache_on_vs_off"] >= eval_bench.TARGET_SPEEDUP), speedup
    json.dumps(report)  # `--out` writes it as JSON
    table = eval_bench.markdown(report)
    assert table.startswith("| mode | total s | x cache-off |")
    assert all(f"| {mode} |" in table for mode in modes)
    assert report["cpu"]["cpu"] in table and ">= 2.5x" in table and ("not met" in table or ": met" in table)


def test_the_cli_parses_bench_eval():
    args = build_parser().parse_args(["bench", "eval", "--questions", "4", "--dtype", "bf16", "--out", "x"])
    assert (args.questions, args.context_tokens, args.repeats, args.dtype, args.threads, args.out) == (
        4, 400, 3, "bf16", 2, "x")
    assert args.func.__name__ == "cmd_bench_eval"
