"""Which `cache.policy` each preset should carry: each preset's own scenario workload, tokenized as the engine does
(the embedded model's tokenizer and chat template), replayed through the cache simulator (the engine's manager and
policy code) under the preset's settings, at pool sizes from a quarter of the workload's distinct blocks to all of
them. Deterministic (the workloads are seeded); prints a Markdown table of the share of prompt tokens reused (prefix
hits and, where the preset turns segment reuse on, reused segments).

    .venv/bin/python scripts/preset_policies.py [--requests 96]
"""

from __future__ import annotations

import argparse

from kvreuse.analyze import tokenize
from kvreuse.bench.workloads import WORKLOADS
from kvreuse.config import PRESETS, load_config
from kvreuse.kvcache.eviction import POLICIES
from kvreuse.kvcache.simulate import simulate
from kvreuse.weights.loader import embedded_model_path, file_sha256
from kvreuse.weights.tokenizer import Tokenizer

SCENARIOS = {"chat": "chat", "eval": "eval", "agent": "agent", "rag": "rag"}  # preset -> workload
SHARES = (0.25, 0.5, 1.0)  # pool sizes, as shares of the workload's distinct full blocks


def distinct_blocks(prompts: list[list[int]], block_size: int) -> int:
    return len({tuple(p[:(i + 1) * block_size]) for p in prompts for i in range(len(p) // block_size)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96, help="conversations per workload (default 96)")
    args = parser.parse_args()
    path = embedded_model_path()
    tokenizer = Tokenizer.load(path, file_sha256([path]))
    print("| preset | pool (share of distinct blocks) | " + " | ".join(POLICIES) + " |")
    print("|---" * (2 + len(POLICIES)) + "|")
    for preset, workload in SCENARIOS.items():
        base = load_config(overrides=[f"cache.preset={preset}"]).cache
        prompts = [tokenize(tokenizer, c, base.normalize_input) for c in WORKLOADS[workload](args.requests)]
        num_distinct = distinct_blocks(prompts, base.block_size)
        longest = max(-(-len(p) // base.block_size) for p in prompts)
        for share in SHARES:
            num_blocks = max(longest + 1, int(share * num_distinct))
            rates = []
            for policy in POLICIES:
                cache = base.model_copy(update={"policy": policy, "max_blocks": num_blocks})
                record = simulate(prompts, cache, "preset-policies", num_blocks)
                rates.append((record.cached_tokens + record.reused_tokens) / record.prompt_tokens)
            best = max(rates)
            cells = [f"**{r:.3f}**" if r == best else f"{r:.3f}" for r in rates]
            print(f"| {preset} ({PRESETS[preset].get('policy', 'lru')}) | {share:.2f} ({num_blocks:,} blocks) | "
                  + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
