"""Prompt attention on a CPU: the row-by-row op (layers/row_attention.py, kernels/prefill_attention.cpp) against one
SDPA call over the padded batch (`padded_attention`, what ran before), interleaved (rows, sdpa, rows, sdpa, ...).

- One layer's attention for a 2,048-token prompt from position 0 (SDPA's causal path), and for its last 1,024 or 64
  rows after 1,024 or 1,984 cached (a hit's suffix: SDPA's masked path), on SmolLM2's shapes (9 heads, 3 KV heads,
  head_dim 64) and Gemma 3 270M's (4, 1, 256; a global layer, and a local one with a 512-key window), fp32 pool;
  SmolLM2's in bf16 too.
- A whole 2,048-token prefill (one token generated, no cache) of the embedded SmolLM2 and of gemma3-270m, in fp32
  and bf16 (`--model-dtypes`), the default GGUF weights, each path in turn on one engine.

Prints the CPU, every time and the medians.

    .venv/bin/python scripts/prefill_attention_timing.py [--rounds 5] [--model-rounds 3] [--no-models]
        [--model-dtypes fp32 bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvreuse.layers import attention
from kvreuse.layers.attention import AttentionMetadata, padded_attention
from kvreuse.layers.kv_format import FORMATS
from kvreuse.tuning.dtype_probe import cpu_identity

ROWS = attention.attend_in_basis  # what a step's prompt attention calls: the row op on a CPU
SHAPES = {"smollm2": (9, 3, 64, 0), "gemma3-global": (4, 1, 256, 0), "gemma3-local": (4, 1, 256, 512)}
BLOCK = 16


def layer_case(shape: tuple[int, int, int, int], cached: int, length: int, dtype: torch.dtype):
    num_heads, num_kv_heads, head_dim, window = shape
    gen = torch.Generator().manual_seed(0)
    blocks = length // BLOCK + 1  # block 0 is the null block
    table = torch.randperm(blocks - 1, generator=gen).add(1).tolist()
    kv_format = FORMATS["fp32" if dtype == torch.float32 else "bf16"]
    pool = [kv_format.encode(torch.randn(blocks, BLOCK, num_kv_heads, head_dim, generator=gen).to(dtype))
            for _ in range(2)]
    meta = AttentionMetadata.build([cached], [length - cached], [table], BLOCK, torch.device("cpu"))
    q = torch.randn(length - cached, num_heads, head_dim, generator=gen).to(dtype) * head_dim ** -0.25
    return q, pool, meta, head_dim ** -0.5, window or None


def time_layers(rounds: int) -> None:
    cases = [(name, cached, torch.float32) for name in SHAPES for cached in (0, 1024, 1984)]
    cases.append(("smollm2", 0, torch.bfloat16))
    for name, cached, dtype in cases:
        q, (k_cache, v_cache), meta, scale, window = layer_case(SHAPES[name], cached, 2048, dtype)
        times = {"rows": [], "sdpa": []}
        for _ in range(rounds):
            for path, fn in (("rows", ROWS), ("sdpa", padded_attention)):
                began = time.perf_counter()
                fn(q, k_cache, v_cache, meta, scale, window)
                times[path].append(time.perf_counter() - began)
        rows, sdpa = (statistics.median(times[p]) * 1e3 for p in ("rows", "sdpa"))
        print(f"layer {name:14s} {str(dtype)[6:]:8s} rows {cached}-2047: rows {rows:7.1f} ms, sdpa {sdpa:7.1f} ms, "
              f"rows/sdpa {rows / sdpa:.2f}x  (rows {[round(t * 1e3, 1) for t in times['rows']]}, "
              f"sdpa {[round(t * 1e3, 1) for t in times['sdpa']]})", flush=True)


def time_models(rounds: int, dtypes: list[str]) -> None:
    from kvreuse.config import load_config
    from kvreuse.llm import LLM
    from kvreuse.sampling_params import SamplingParams

    for model, dtype in ((m, d) for d in dtypes for m in ("", "gemma3-270m")):
        sets = [f"model.path={model}"] if model else []
        with LLM(load_config(None, [*sets, f"model.dtype={dtype}", "engine.compile=off", "server.max_tokens=4096"])) \
                as llm:
            prompt = (llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 300))[:2048]
            params = SamplingParams(max_tokens=1, ignore_eos=True)
            llm.generate(prompt[:64], params, use_cache=False)  # warm
            times = {"rows": [], "sdpa": []}
            for _ in range(rounds):
                for path, fn in (("rows", ROWS), ("sdpa", padded_attention)):
                    attention.attend_in_basis = fn
                    began = time.perf_counter()
                    llm.generate(prompt, params, use_cache=False)
                    times[path].append(time.perf_counter() - began)
            attention.attend_in_basis = ROWS
        rows, sdpa = (statistics.median(times[p]) for p in ("rows", "sdpa"))
        print(f"prefill {model or 'embedded SmolLM2'} {dtype} {len(prompt)} tokens: rows {rows:.2f} s, "
              f"sdpa {sdpa:.2f} s, "
              f"rows/sdpa {rows / sdpa:.2f}x  (rows {[round(t, 2) for t in times['rows']]}, "
              f"sdpa {[round(t, 2) for t in times['sdpa']]})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the one-layer times")
    parser.add_argument("--model-rounds", type=int, default=3, help="rounds of the whole prefills")
    parser.add_argument("--no-models", action="store_true")
    parser.add_argument("--model-dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                        help="model dtypes of the whole prefills")
    args = parser.parse_args()
    flags = open("/proc/cpuinfo").read().split("flags\t\t:")[1].splitlines()[0].split()
    print(f"CPU: {cpu_identity()}; threads {torch.get_num_threads()}; "
          f"{' '.join(f for f in flags if f.startswith(('avx512', 'avx2', 'fma', 'amx')))}", flush=True)
    time_layers(args.rounds)
    if not args.no_models:
        time_models(args.model_rounds, args.model_dtypes)


if __name__ == "__main__":
    main()
