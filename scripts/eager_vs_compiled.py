"""What a decode step that runs eagerly (while the compiled step is being built, at a first start) changes against the
compiled step: one engine per path (`engine.compile=off`, and the defaults' compiled step, waited for), the six
parity-style prompts of `kvreuse fidelity`, 64 greedy tokens each with their logprobs. Prints per model dtype: the
identical continuations, their common prefixes, and the largest and mean |logprob difference| of the tokens both
paths chose over the common prefixes.

    .venv/bin/python scripts/eager_vs_compiled.py [--model-dtypes bf16 fp32] [--model gemma3-270m ...]
"""

from __future__ import annotations

import argparse
import statistics

from kvreuse.bench.kv_fidelity import prompts
from kvreuse.config import load_config
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams
from kvreuse.tuning.dtype_probe import cpu_identity

NUM_TOKENS = 64


def continuations(overrides: list[str], compile_on: bool) -> list[tuple[list[int], list[float]]]:
    sets = [*overrides, "server.max_tokens=4096"] + ([] if compile_on else ["engine.compile=off"])
    with LLM(load_config(None, sets)) as llm:
        if compile_on:
            state = llm.wait_compiled(1800)
            assert state == "compiled", f"the decode step did not compile: {state}"
        params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
        outs = llm.generate(prompts(llm), params, use_cache=False)
        return [(o.token_ids, [r.logprob for r in o.logprobs]) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--model", nargs="*", default=[], help="more settings: the model's path and chat template")
    args = parser.parse_args()
    print(f"CPU: {cpu_identity()}", flush=True)
    for dtype in args.model_dtypes:
        overrides = [*args.model, f"model.dtype={dtype}"]
        eager, compiled = (continuations(overrides, on) for on in (False, True))
        prefixes, diffs = [], []
        for (a_ids, a_lp), (b_ids, b_lp) in zip(eager, compiled, strict=True):
            common = next((i for i, (x, y) in enumerate(zip(a_ids, b_ids, strict=True)) if x != y), len(a_ids))
            prefixes.append(common)
            diffs += [abs(x - y) for x, y in zip(a_lp[:common], b_lp[:common], strict=True)]
        same = sum(p == NUM_TOKENS for p in prefixes)
        print(f"{' '.join(overrides)}: eager vs compiled decode: {same} of {len(prefixes)} continuations identical "
              f"(common prefixes {prefixes}); chosen tokens' |logprob difference| max {max(diffs):.2e}, "
              f"mean {statistics.mean(diffs):.2e}, {sum(d == 0 for d in diffs)} of {len(diffs)} equal", flush=True)


if __name__ == "__main__":
    main()
