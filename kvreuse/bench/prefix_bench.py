"""`kvreuse bench prefix`: TTFT of a cold 2048-token prompt against a second request that shares
its first 1984 tokens, and a third that repeats the first whole (fully cached: only its last token is computed),
whose decode steps give the floor (one decode step at that context); interleaved cold, warm, full, cold ... in one
engine."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from kvreuse.bench.engine_bench import synthetic_prompt
from kvreuse.config import load_config
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

PROMPT_LEN = 2048
SHARED_LEN = 1984
FLOOR_STEPS = 8  # decode steps of the fully cached request, timed for the floor


def run(repeats: int = 5, progress=print, model: str | None = None, sets: Sequence[str] = ()) -> dict:
    """`model`: a path or name (default: the embedded model); `sets`: further `section.key=value` overrides
    (`cache.sliding_kv=full`, say)."""
    llm = LLM(load_config(None, ["model.dtype=fp32", "server.max_tokens=4096", "engine.max_num_batched_tokens=2048",
                                 "engine.kv_cache_memory_mb=1024", *([f"model.path={model}"] if model else []),
                                 *sets]))
    llm.wait_compiled()
    params = SamplingParams(max_tokens=1)
    cold, warm, cached, full, step = [], [], [], [], []
    for round_index in range(repeats + 1):  # round 0 warms up and is discarded
        prompt = synthetic_prompt(llm.tokenizer, PROMPT_LEN, variant=1000 + round_index)
        other_tail = synthetic_prompt(llm.tokenizer, PROMPT_LEN - SHARED_LEN, variant=5000 + round_index)
        first = llm.generate(prompt, params)[0]
        second = llm.generate(prompt[:SHARED_LEN] + other_tail, params)[0]
        third = llm.generate(prompt, SamplingParams(max_tokens=FLOOR_STEPS + 1, ignore_eos=True))[0]
        assert first.usage.cached_tokens == 0, "the cold request must not hit"
        assert third.usage.computed_prompt_tokens == 1, "the repeated prompt must be fully cached"
        third_step = (third.total_s - third.ttft_s) / FLOOR_STEPS
        if round_index:
            cold.append(first.ttft_s)
            warm.append(second.ttft_s)
            cached.append(second.usage.cached_tokens)
            full.append(third.ttft_s)
            step.append(third_step)
        progress(f"round {round_index}/{repeats}: cold {first.ttft_s * 1000:.0f} ms, "
                 f"warm {second.ttft_s * 1000:.0f} ms ({second.usage.cached_tokens} cached tokens), "
                 f"fully cached {third.ttft_s * 1000:.0f} ms (decode step {third_step * 1000:.0f} ms)")
    cold_ms, warm_ms = statistics.median(cold) * 1000, statistics.median(warm) * 1000
    full_ms, step_ms = statistics.median(full) * 1000, statistics.median(step) * 1000
    front = llm.engine.front_end
    return {"suite": "prefix", "model": model or "SmolLM2-135M-Instruct (embedded GGUF)", "sets": list(sets),
            "kv_layout": front.kv_layout.describe(), "repeats": repeats, "prompt_tokens": PROMPT_LEN,
            "shared_tokens": SHARED_LEN,
            "cached_tokens": statistics.median(cached), "median_ttft_ms_cold": cold_ms,
            "median_ttft_ms_warm": warm_ms, "warm_over_cold": warm_ms / cold_ms,
            "median_ttft_ms_full": full_ms, "median_decode_step_ms": step_ms, "full_over_step": full_ms / step_ms,
            "samples_ms": {"cold": [x * 1000 for x in cold], "warm": [x * 1000 for x in warm],
                           "full": [x * 1000 for x in full], "step": [x * 1000 for x in step]}}


def markdown(report: dict) -> str:
    return (f"{report['model']}, KV pool: {report['kv_layout']}\n\n"
            f"| prompt | shared | cached | cold TTFT (ms) | warm TTFT (ms) | warm/cold |\n|---|---|---|---|---|---|\n"
            f"| {report['prompt_tokens']} | {report['shared_tokens']} | {report['cached_tokens']:.0f} | "
            f"{report['median_ttft_ms_cold']:.0f} | {report['median_ttft_ms_warm']:.0f} | "
            f"{report['warm_over_cold']:.3f} |\n\n"
            f"Fully cached (the same {report['prompt_tokens']} tokens again): "
            f"TTFT {report['median_ttft_ms_full']:.1f} ms, "
            f"one decode step at that context {report['median_decode_step_ms']:.1f} ms: "
            f"{report['full_over_step']:.2f}x the floor")
