"""What int8's Hadamard basis costs: one engine per model (cache.kv_dtype=int8, the defaults otherwise: compile on,
model.dtype auto), the basis switched on and off between rounds (A B A B, 4 rounds, medians): decode TPOT at batch 1
and 4 (64 tokens after a 1-token run) and a 2,048-token cold prefill. Speeds only: the switched-off rounds read rows
written in the basis, so their outputs mean nothing.

    .venv/bin/python scripts/kv_basis_timing.py embedded gemma3-270m
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time

import torch

from kvreuse.config import load_config
from kvreuse.layers import kv_format
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams
from kvreuse.tuning.dtype_probe import cpu_identity

ROUNDS = 4
ROTATED = kv_format.FORMATS["int8"]
PLAIN = dataclasses.replace(ROTATED, rotated=False)


def timed(llm: LLM, prompts, params: SamplingParams) -> float:
    began = time.perf_counter()
    llm.generate(prompts, params, use_cache=False)
    return time.perf_counter() - began


def time_model(model: str) -> None:
    sets = [f"model.path={model}"] if model != "embedded" else []
    llm = LLM(load_config(None, [*sets, "cache.kv_dtype=int8", "engine.num_kv_blocks=2048", "server.max_tokens=4096"]))
    assert llm.wait_compiled(900) == "compiled"
    prompts = [llm.tokenizer.encode(f"Write a long story about a robot number {i} who learns to paint.")
               for i in range(4)]
    long = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 300)[:2048]
    one, more = SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=65, ignore_eos=True)
    times = {case: {"rotated": [], "plain": []} for case in ("tpot_b1_ms", "tpot_b4_ms", "prefill_s")}
    for _ in range(ROUNDS):
        for name, fmt in (("rotated", ROTATED), ("plain", PLAIN)):
            kv_format._BY_STORAGE[torch.int8] = fmt  # what format_of answers for the int8 pool
            for batch in (1, 4):
                first, whole = timed(llm, prompts[:batch], one), timed(llm, prompts[:batch], more)
                times[f"tpot_b{batch}_ms"][name].append((whole - first) / 64 * 1000)
            times["prefill_s"][name].append(timed(llm, long, one))
    kv_format._BY_STORAGE[torch.int8] = ROTATED
    for case, runs in times.items():
        rotated, plain = (statistics.median(runs[n]) for n in ("rotated", "plain"))
        print(f"{model} {llm.engine.dtype_description} {case}: rotated {rotated:.3f} plain {plain:.3f} "
              f"ratio {rotated / plain:.3f}  {json.dumps({n: [round(x, 3) for x in xs] for n, xs in runs.items()})}",
              flush=True)
    llm.engine.close()


if __name__ == "__main__":
    print(cpu_identity(), torch.get_num_threads(), flush=True)
    for name in sys.argv[1:]:
        time_model(name)
