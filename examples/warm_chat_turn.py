"""A warm chat turn against a cold one, turn by turn (docs/benchmarks.md, "A warm chat turn").

    .venv/bin/python examples/warm_chat_turn.py [--long-system] [--set section.key=value ...]

An 8-turn chat with 32-token answers in fp32, the compiled step ready: each turn is run cold (`use_cache=False`)
and then warm, their outputs asserted equal, and each TTFT printed with the time the chat template and tokenizer
took. `--long-system` opens the chat with the chat benchmark's system prompt (kvreuse.bench.workloads.CHAT_SYSTEM)
instead of a one-line one, as deployed assistants do.
"""

from __future__ import annotations

import argparse
import time

from kvreuse.bench.workloads import CHAT_SYSTEM
from kvreuse.config import load_config
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

QUESTIONS = ["What is a KV cache?", "Why does prefix caching help multi-turn chat?", "Name three eviction policies.",
             "What is LRU?", "And LFU?", "Which is better for chat?", "Summarise our talk.", "Thanks!"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-system", action="store_true", help="the chat benchmark's system prompt")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args()
    with LLM(load_config(None, ["model.dtype=fp32", *args.overrides])) as llm:
        print("compiled step:", llm.wait_compiled(900))
        front = llm.engine.front_end
        system = CHAT_SYSTEM if args.long_system else "You are a concise assistant for a team that runs LLM servers."
        messages = [{"role": "system", "content": system}]
        params = SamplingParams(max_tokens=32)
        print("| turn | prompt tokens | cached | template+tokenize ms | cold TTFT ms | warm TTFT ms | warm/cold |")
        print("|---|---|---|---|---|---|---|")
        for turn, question in enumerate(QUESTIONS, 1):
            messages.append({"role": "user", "content": question})
            start = time.perf_counter()
            ids = front.tokenize_chat(messages)
            tokenize_s = time.perf_counter() - start
            cold = llm.generate([ids], params, use_cache=False)[0]
            warm = llm.generate([ids], params)[0]
            assert warm.token_ids == cold.token_ids, f"turn {turn}: the warm answer differs from the cold one"
            print(f"| {turn} | {len(ids)} | {warm.usage.cached_tokens} | {tokenize_s * 1e3:.1f} | "
                  f"{cold.ttft_s * 1e3:.0f} | {warm.ttft_s * 1e3:.0f} | {warm.ttft_s / cold.ttft_s:.2f} |")
            messages.append({"role": "assistant", "content": warm.text})


if __name__ == "__main__":
    main()
