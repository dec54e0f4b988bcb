"""`kvreuse bench eval`: multiple-choice evaluation as lm-evaluation-harness sends it, scored three ways.

Each question is a context of ~400 tokens (documents from the shipped corpus and a question line) and 4 short answer
choices. As lm-eval's `loglikelihood` requests, a question is 4 prompts: the context + each choice, tokenized whole,
scored with echo + logprobs + max_tokens=1; an answer's score is the sum of the logprobs of its tokens (positions
ctxlen.. of the prompt, ctxlen the length of the context tokenized alone). The highest score is the prediction (acc),
and the highest score per character of the choice (acc_norm).

Modes, interleaved question by question (cache-on, cache-off, hf, then the next question), on the same weights in
the same dtype: kvreuse with prefix caching (the 4 prompts submitted together, as lm-eval batches them: the first
computes the context and the others reuse its blocks and stored prompt logprobs), kvreuse with `use_cache=False`
on the same engine, and HF transformers with one forward per prompt (log_softmax over the logits, gather). The
prefix cache is emptied before every cache-on question, so each question starts cold: only the reuse within a
question is measured, as in an eval whose contexts share nothing. A short warm-up question runs first in every
mode and is discarded; each of `repeats` rounds runs every question. A mode's time is the sum over questions of each
one's median over the rounds (a burst of someone else's load then spoils one sample, not a whole round's total).

The predictions must be identical across modes (a BenchError otherwise): exactly between cache-on and cache-off,
and against HF except at a near-tie, where the top two kvreuse scores are closer than twice what the scores differ
by between the two systems (different kernels round differently; such flips are counted and reported)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvreuse.bench.engine_bench import machine
from kvreuse.bench.peers import load_hf
from kvreuse.bench.tiers_bench import expect
from kvreuse.bench.workloads import documents
from kvreuse.config import load_config
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams
from kvreuse.tuning.dtype_probe import cpu_identity

MODES = ("cache-on", "cache-off", "hf")
NUM_CHOICES = 4
TARGET_SPEEDUP = 2.5  # cache-on over cache-off, on 4-choice questions with 300+ token contexts
SCORING = SamplingParams(max_tokens=1, prompt_logprobs=1, logprobs=1)  # what lm-eval's echo + logprobs asks for
WARMUP_CONTEXT_TOKENS = 64
QUESTION_LINE = "\n\nQuestion: Which Python module is the first document above about?\nAnswer:"


@dataclass(frozen=True)
class Question:
    requests: list[list[int]]  # per choice: context + choice, tokenized whole
    ctxlen: int                # tokens of the context tokenized alone: the scored positions start here
    choices: list[str]
    gold: int


@dataclass
class Scored:
    sums: list[float]          # per choice: the sum of its tokens' logprobs
    seconds: float
    prompt_tokens: int
    computed_tokens: int       # prompt tokens run through the model
    cached_tokens: int


def _module(doc: dict) -> str:
    return doc["title"].split()[-1]


def make_questions(tokenizer, num_questions: int, context_tokens: int, seed: int = 0) -> list[Question]:
    """Question q: a header naming it (so no two questions share a first block), the corpus documents from q on,
    cut to about `context_tokens` tokens, and the question line; choices " the <module> module", the first
    document's module among 3 others, shuffled."""
    docs, rng = documents(), random.Random(seed)
    questions = []
    for q in range(num_questions):
        body, i = f"Document set {q + 1}.\n\n", 0
        while len(tokenizer.encode(body)) < context_tokens:
            doc = docs[(q + i) % len(docs)]
            body += f"[{i + 1}] {doc['title']}\n{doc['text']}\n\n"
            i += 1
        body = tokenizer.decode(tokenizer.encode(body)[:context_tokens]).rstrip()
        context = body + QUESTION_LINE
        gold_module = _module(docs[q % len(docs)])
        others = rng.sample([_module(d) for d in docs if _module(d) != gold_module], NUM_CHOICES - 1)
        modules = [gold_module, *others]
        rng.shuffle(modules)
        choices = [f" the {m} module" for m in modules]
        # As lm-eval's _encode_pair: the whole text tokenized once; ctxlen from the context alone.
        questions.append(Question([tokenizer.encode(context + c) for c in choices], len(tokenizer.encode(context)),
                                  choices, modules.index(gold_module)))
    return questions


def score_kvreuse(llm: LLM, question: Question, use_cache: bool) -> Scored:
    if use_cache:
        llm.engine.reset_prefix_cache()  # every question starts cold (rounds repeat the same questions)
    start = time.perf_counter()
    outs = llm.generate(question.requests, SCORING, use_cache=use_cache)  # one batch, as lm-eval sends it
    seconds = time.perf_counter() - start
    for out in outs:
        expect(out.finish_reason != "error" and out.prompt_logprobs is not None, f"a request failed: {out.error}")
    sums = [sum(r.logprob for r in out.prompt_logprobs[question.ctxlen:]) for out in outs]
    return Scored(sums, seconds, sum(o.usage.prompt_tokens for o in outs),
                  sum(o.usage.computed_prompt_tokens for o in outs), sum(o.usage.cached_tokens for o in outs))


@torch.inference_mode()
def score_hf(model, question: Question) -> Scored:
    start = time.perf_counter()
    sums = []
    for ids in question.requests:
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # [tokens, vocab]
        logprobs = torch.log_softmax(logits.float(), dim=-1)      # over every position, as lm-eval's HFLM does
        answer = torch.tensor(ids[question.ctxlen:])              # [answer tokens]
        # Position p - 1 predicts token p.
        picked = logprobs[question.ctxlen - 1:-1].gather(-1, answer[:, None])  # [answer tokens, 1]
        sums.append(sum(picked.squeeze(-1).tolist()))
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) for ids in question.requests)
    return Scored(sums, seconds, tokens, tokens, 0)


def predictions(question: Question, sums: list[float]) -> tuple[int, int]:
    """(acc choice, acc_norm choice): the highest sum, and the highest sum per character of the choice."""
    acc = max(range(len(sums)), key=lambda i: sums[i])
    norm = max(range(len(sums)), key=lambda i: sums[i] / len(question.choices[i]))
    return acc, norm


def run(num_questions: int = 16, context_tokens: int = 400, repeats: int = 3, dtype: str = "fp32",
        threads: int | None = 2, progress: Callable[[str], None] = print, model_path: str | None = None,
        kv_cache_memory_mb: int = 512) -> dict:
    """Run the suite; `model_path` (`model.path`, default the embedded model) and `kv_cache_memory_mb` are for
    tests. `threads`: torch threads for the run (None: torch's own), restored after."""
    expect(repeats >= 1 and num_questions >= 1, "repeats and num_questions must be >= 1")
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        overrides = [f"model.dtype={dtype}", "server.max_tokens=4096", "engine.max_num_batched_tokens=2048",
                     f"engine.kv_cache_memory_mb={kv_cache_memory_mb}", "cache.enabled=true"]
        if model_path:
            overrides.append(f"model.path={model_path}")
        llm = LLM(load_config(None, overrides))
        llm.wait_compiled()
        try:
            model, _ = load_hf(model_path, llm.engine.dtype)
            return _measure(llm, model, num_questions, context_tokens, repeats, progress)
        finally:
            llm.engine.close()
    finally:
        torch.set_num_threads(previous)


def _measure(llm: LLM, model, num_questions: int, context_tokens: int, repeats: int,
             progress: Callable[[str], None]) -> dict:
    questions = make_questions(llm.tokenizer, num_questions, context_tokens)
    # Its own header (no block shared with the others); short, as it only has to warm the code paths up.
    warmup = make_questions(llm.tokenizer, num_questions + 1, WARMUP_CONTEXT_TOKENS)[-1]
    run_mode = {"cache-on": lambda q: score_kvreuse(llm, q, use_cache=True),
                "cache-off": lambda q: score_kvreuse(llm, q, use_cache=False),
                "hf": lambda q: score_hf(model, q)}
    for mode in MODES:
        run_mode[mode](warmup)
    seconds: dict[str, list[list[float]]] = {m: [[] for _ in questions] for m in MODES}  # [question][round]
    checks: list[tuple[dict[str, float], int]] = []
    for round_index in range(repeats):
        scored: dict[str, list[Scored]] = {m: [] for m in MODES}
        for q, question in enumerate(questions):
            for mode in MODES:  # interleaved: A B C per question
                scored[mode].append(run_mode[mode](question))
                seconds[mode][q].append(scored[mode][-1].seconds)
        checks.append((_max_diffs(scored), _check_predictions(questions, scored)))
        progress(f"round {round_index + 1}/{repeats}: "
                 + ", ".join(f"{m} {sum(s.seconds for s in scored[m]):.2f} s" for m in MODES))
    diffs = {pair: max(d[pair] for d, _ in checks) for pair in checks[0][0]}
    return _report(llm, questions, seconds, scored, diffs, max(n for _, n in checks), repeats)


def _max_diffs(scored: dict[str, list[Scored]]) -> dict[str, float]:
    """Per pair of modes, the largest difference of an answer's score between them."""
    def most(a: list[Scored], b: list[Scored]) -> float:
        return max(abs(x - y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa.sums, sb.sums, strict=True))

    return {f"{a} vs {b}": most(scored[a], scored[b]) for i, a in enumerate(MODES) for b in MODES[i + 1:]}


def _check_predictions(questions: list[Question], scored: dict[str, list[Scored]]) -> int:
    """Identical predictions across modes (BenchError otherwise); how many HF flips were near-ties (see above)."""
    near_ties = 0
    for q, question in enumerate(questions):
        on, off, hf = (scored[m][q].sums for m in MODES)
        expect(predictions(question, on) == predictions(question, off),
               f"question {q}: cache-on and cache-off predict differently ({on} vs {off})")
        if predictions(question, on) == predictions(question, hf):
            continue
        noise = max(abs(x - y) for x, y in zip(on, hf, strict=True))
        for k, kind in enumerate(("acc", "acc_norm")):
            if predictions(question, on)[k] == predictions(question, hf)[k]:
                continue
            # acc_norm divides by the characters of each choice, and so the noise, at most by the fewest.
            scale = 1.0 if kind == "acc" else 1 / min(map(len, question.choices))
            per_choice = on if kind == "acc" else [x / len(c) for x, c in zip(on, question.choices, strict=True)]
            first, second = sorted(per_choice, reverse=True)[:2]
            expect(first - second <= 2 * noise * scale,  # both scores may move by the noise
                   f"question {q}: HF predicts differently ({kind}) beyond a near-tie: kvreuse {on}, HF {hf}")
        near_ties += 1
    return near_ties


def _report(llm: LLM, questions: list[Question], seconds: dict[str, list[list[float]]],
            scored: dict[str, list[Scored]], diffs: dict[str, float], near_ties: int, repeats: int) -> dict:
    """`seconds`: per mode, per question, per round; `scored`: the last round (token counts and predictions are the
    same in every round: the runs are deterministic and the predictions were checked each round)."""
    golds = [q.gold for q in questions]
    # The machine is shared: a round's total can carry a burst of someone else's load. Per question, the median over
    # rounds; and the speedup also as the median of the ratios of neighbouring runs (the same question and round).
    total = {m: sum(statistics.median(per_round) for per_round in seconds[m]) for m in MODES}
    paired = statistics.median(off / on for offs, ons in zip(seconds["cache-off"], seconds["cache-on"], strict=True)
                               for off, on in zip(offs, ons, strict=True))
    modes = {}
    for mode in MODES:
        picks = [predictions(q, s.sums) for q, s in zip(questions, scored[mode], strict=True)]
        modes[mode] = {
            "total_s": total[mode],
            "round_totals_s": [sum(per_round[r] for per_round in seconds[mode]) for r in range(repeats)],
            "prompt_tokens": sum(s.prompt_tokens for s in scored[mode]),
            "prefill_tokens": sum(s.computed_tokens for s in scored[mode]),
            "cached_tokens": sum(s.cached_tokens for s in scored[mode]),
            "acc": sum(a == g for (a, _), g in zip(picks, golds, strict=True)) / len(questions),
            "acc_norm": sum(n == g for (_, n), g in zip(picks, golds, strict=True)) / len(questions),
            "predictions_acc": [a for a, _ in picks], "predictions_acc_norm": [n for _, n in picks],
            "samples_s": seconds[mode]}
    speedup = total["cache-off"] / total["cache-on"]
    context_lengths = [q.ctxlen for q in questions]
    answer_lengths = [len(ids) - q.ctxlen for q in questions for ids in q.requests]
    return {"suite": "eval", "repeats": repeats, "questions": len(questions), "choices": NUM_CHOICES,
            "context_tokens": {"min": min(context_lengths), "median": statistics.median(context_lengths),
                               "max": max(context_lengths)},
            "answer_tokens": {"min": min(answer_lengths), "max": max(answer_lengths)},
            "block_size": llm.engine.block_size, "dtype": llm.engine.dtype_description, "cpu": cpu_identity(),
            "machine": machine(), "modes": modes,
            "speedup": {"cache_on_vs_off": speedup, "paired_median": paired, "target": f">= {TARGET_SPEEDUP}x",
                        "met": speedup >= TARGET_SPEEDUP, "cache_on_vs_hf": total["hf"] / total["cache-on"]},
            "max_abs_score_diff": diffs,
            "predictions_match": True,  # checked every round (BenchError otherwise)
            "hf_near_tie_flips": near_ties, "gold": golds}


def markdown(report: dict) -> str:
    lines = ["| mode | total s | x cache-off | prompt tokens | prefill tokens | cached tokens | acc | acc_norm |",
             "|---|---|---|---|---|---|---|---|"]
    off_s = report["modes"]["cache-off"]["total_s"]
    for mode, row in report["modes"].items():
        lines.append(f"| {mode} | {row['total_s']:.2f} | {off_s / row['total_s']:.2f} | {row['prompt_tokens']} | "
                     f"{row['prefill_tokens']} | {row['cached_tokens']} | {row['acc']:.3f} | {row['acc_norm']:.3f} |")
    s, cpu, ctx, ans = report["speedup"], report["cpu"], report["context_tokens"], report["answer_tokens"]
    diffs = ", ".join(f"{pair} {value:.2e}" for pair, value in report["max_abs_score_diff"].items())
    rounds = f"{report['repeats']} round{'s' if report['repeats'] != 1 else ''}"
    lines += ["",
              f"{report['questions']} questions x {report['choices']} choices (contexts {ctx['min']}-{ctx['max']} "
              f"tokens, answers {ans['min']}-{ans['max']} tokens), each question's 4 requests in one batch; modes "
              f"interleaved per question; total s: the sum over questions of each one's median of {rounds} (after a "
              f"warm-up question). Speedup cache-on vs cache-off: {s['cache_on_vs_off']:.2f}x (target {s['target']}: "
              f"{'met' if s['met'] else 'not met'}; median of the per-question ratios {s['paired_median']:.2f}x); "
              f"cache-on vs HF: {s['cache_on_vs_hf']:.2f}x.",
              f"Predictions identical across modes (HF near-tie flips: {report['hf_near_tie_flips']}); max abs "
              f"difference of the per-answer logprob sums: {diffs}.",
              f"CPU: {cpu['cpu']} ({cpu['machine']}; flags: {', '.join(cpu['flags']) or 'none'}); "
              f"{report['machine']['torch_threads']} torch threads; dtype: {report['dtype']}; block size "
              f"{report['block_size']}.",
              "Round totals (s, for the noise): " + "; ".join(
                  f"{mode} " + ", ".join(f"{x:.2f}" for x in row["round_totals_s"])
                  for mode, row in report["modes"].items()) + "."]
    return "\n".join(lines)
