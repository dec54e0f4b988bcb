"""`kvreuse bench kv-dtype`: the decode step's rate per `cache.kv_dtype` (fp32, bf16, int8, fp8 K/V rows) on the
default model in fp32, at long contexts, where attention reads the pool and its bytes decide the step.

Each kv_dtype is one engine (decode compiled as by default, or eager), all alive at once. Every case's prompts are
prefilled once per engine, before anything is timed, and kept in its prefix cache (the pool holds them all), so that a
timed round recomputes at most a block of each prompt and decodes: the decode seconds are the time from the batch's
last first token to its last token (engine_bench.decode_s). Rounds run case by case, each engine in turn
(A B C D A B C D ...), after one warm-up round; medians of step milliseconds and their ratio of step rates against the
fp32 pool are reported with the CPU. An fp32 model over a bf16 pool runs the torch ops (the fused kernel takes pools of
q's dtype and 8-bit ones): its row says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvreuse.bench.engine_bench import decode_s, machine, synthetic_prompt
from kvreuse.bench.engine_sizes import BLOCK_SIZE
from kvreuse.bench.timing import Interleaved
from kvreuse.config import load_config
from kvreuse.kernels import build as kernels
from kvreuse.layers.row_attention import kernels_read
from kvreuse.llm import LLM

KV_DTYPES = ("fp32", "bf16", "int8", "fp8")
DECODE_TOKENS = 17  # 16 timed steps a round (the first token is the prefill's)


@dataclass(frozen=True)
class Case:
    """`batch` sequences decoding with about `context` tokens of context each (the last step's context is
    `context` - 1: SmolLM2 holds 8192 positions)."""
    batch: int
    context: int

    @property
    def name(self) -> str:
        return f"b{self.batch}_{self.context // 1024}k" if self.context % 1024 == 0 else f"b{self.batch}_{self.context}"

    @property
    def prompt_len(self) -> int:
        return self.context - DECODE_TOKENS


CASES = (Case(8, 8192), Case(8, 2048), Case(1, 2048))


def prompts_of(tokenizer, case: Case) -> list[list[int]]:
    """The case's prompts: sequence b is variant b of its length (batch 1 reuses batch 8's first prompt of a length)."""
    return [synthetic_prompt(tokenizer, case.prompt_len, variant=b) for b in range(case.batch)]


def engine_settings(cases: tuple[Case, ...], kv_dtype: str, compile: str) -> list[str]:
    """An fp32 engine whose pool and cache keep every case's prompts (a prompt shared by two cases counted once),
    with room for a round's decoded blocks."""
    prompts = {(case.prompt_len, b) for case in cases for b in range(case.batch)}
    blocks = sum(math.ceil(length / BLOCK_SIZE) + 2 for length, _ in prompts)
    num_blocks = blocks + blocks // 4 + 64
    batch, longest = max(c.batch for c in cases), max(c.context for c in cases)
    return ["model.dtype=fp32", f"cache.kv_dtype={kv_dtype}", f"engine.compile={compile}", "cache.enabled=true",
            f"cache.block_size={BLOCK_SIZE}", f"cache.max_blocks={num_blocks}", f"engine.num_kv_blocks={num_blocks}",
            f"engine.max_num_seqs={max(16, batch)}", f"server.max_tokens={max(8192, longest)}",
            "engine.max_num_batched_tokens=2048"]


def fused(llm: LLM) -> bool:
    """Whether this engine's decode attention runs the fused kernel (attention.store_and_attend's condition)."""
    return kernels.load().loaded and kernels_read(torch.float32, llm.engine.runner.kv_cache)  # the fp32 model


def bytes_per_token(llm: LLM) -> int:
    """The pool's bytes per token: K and V rows of every layer, scales included."""
    pool = llm.engine.runner.kv_cache                                     # [layers, 2, blocks, block_size, Hkv, W]
    return pool[:, :, 0].numel() * pool.element_size() // pool.shape[3]


def run(repeats: int = 5, kv_dtypes: tuple[str, ...] = KV_DTYPES, cases: tuple[Case, ...] = CASES,
        compile: str = "decode", progress: Callable[[str], None] = print) -> dict:
    """Every kv_dtype's engine through every case, `repeats` interleaved rounds after a warm-up one: the report."""
    engines: dict[str, LLM] = {}
    states = {}  # the decode step each engine runs: compiled, eager, or failed (eager: its graphs could not be built)
    for name in kv_dtypes:
        engines[name] = LLM(load_config(None, engine_settings(cases, name, compile)))
        states[name] = engines[name].wait_compiled()
        progress(f"{name}: engine up (decode {states[name]})")
    tokenizer = next(iter(engines.values())).tokenizer
    batches = {case: prompts_of(tokenizer, case) for case in cases}
    for name, llm in engines.items():  # the prefills, once, into each prefix cache
        for batch in batches.values():
            llm.generate(batch, _params(1))
        progress(f"{name}: prompts cached")
    results, cached = Interleaved(), {}
    for round_index in range(repeats + 1):  # round 0 warms every engine up and is discarded
        for case, batch in batches.items():
            for name, llm in engines.items():
                seconds = decode_s(llm, batch, DECODE_TOKENS)
                cached[(name, case.name)] = min(o.usage.cached_tokens for o in llm.generate(batch, _params(1)))
                if round_index:
                    results.add(name, case.name, seconds / (DECODE_TOKENS - 1) * 1e3)
        progress(f"round {round_index}/{repeats} done")
    report = _report(engines, results, cases, repeats, states, cached)
    for llm in engines.values():
        llm.engine.close()
    return report


def _params(max_tokens: int):
    from kvreuse.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _report(engines: dict[str, LLM], results: Interleaved, cases: tuple[Case, ...], repeats: int,
            states: dict[str, str], cached: dict) -> dict:
    names = list(engines)
    step_ms = {name: {c.name: results.median(name, c.name) for c in cases} for name in names}
    ratios = {name: {c.name: results.ratio(c.name, "fp32", name) for c in cases} for name in names
              if "fp32" in engines and name != "fp32"}  # fp32's step ms over this one's: its step rate over fp32's
    return {"suite": "kv-dtype", "repeats": repeats, "model": "SmolLM2-135M-Instruct (embedded GGUF), model.dtype fp32",
            "decode": states, "decode_steps_per_round": DECODE_TOKENS - 1,
            "cases": [asdict(c) | {"name": c.name} for c in cases],
            "bytes_per_token": {name: bytes_per_token(engines[name]) for name in names},
            "fused_kernel": {name: fused(engines[name]) for name in names},
            "min_cached_prompt_tokens": {f"{n}/{c}": v for (n, c), v in cached.items()},
            "median_step_ms": step_ms, "step_rate_vs_fp32": ratios, "kernels": kernels.load().reason,
            "machine": machine(), "samples": {f"{s}/{m}": v for (s, m), v in results.samples.items()}}


def markdown(report: dict) -> str:
    cases = [c["name"] for c in report["cases"]]
    lines = ["| kv_dtype | bytes/token | fused | " + " | ".join(f"{c} step ms" for c in cases) + " | "
             + " | ".join(f"{c} rate vs fp32" for c in cases) + " |", "|---" * (3 + 2 * len(cases)) + "|"]
    for name, row in report["median_step_ms"].items():
        ratio = report["step_rate_vs_fp32"].get(name, {})
        lines.append(f"| {name} | {report['bytes_per_token'][name]} | {'yes' if report['fused_kernel'][name] else 'no'}"
                     " | " + " | ".join("-" if row[c] is None else f"{row[c]:.1f}" for c in cases) + " | "
                     + " | ".join(f"{ratio[c]:.2f}x" if ratio.get(c) else ("1.00x" if name == "fp32" else "-")
                                  for c in cases) + " |")
    m = report["machine"]
    lines += ["", f"- medians of {report['repeats']} interleaved rounds of {report['decode_steps_per_round']} decode "
              f"steps; decode step "
              + ", ".join(f"{n} {state}" for n, state in report["decode"].items()) + f"; {report['model']}",
              f"- CPU: {m['cpu']} (flags: {', '.join(m.get('flags', [])) or 'none'}), {m['torch_threads']} torch "
              f"threads, torch {m['torch']}; kernels: {report['kernels']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run(repeats=1), indent=2))
