"""`kvreuse bench engine`: cold prefill and decode throughput against peers on the same weights.

Systems, each with caching off so every prefill is cold: kvreuse (fp32), Hugging Face transformers
(fp32 and bf16) on the same GGUF, and llama-cpp-python on the same GGUF when it is installed. Runs are
interleaved round by round (A B C A B C ...) and the medians reported, with ratios to HF.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
from collections.abc import Callable

import torch

from kvreuse.bench.timing import Interleaved, timed
from kvreuse.config import load_config
from kvreuse.llm import LLM
from kvreuse.model.loader import embedded_model_path
from kvreuse.sampling_params import SamplingParams

PREFILL_LENGTHS = (512, 2048)
DECODE_PROMPT_LEN = 128
DECODE_TOKENS = 64
DECODE_BATCHES = (1, 8)


def synthetic_prompt(tokenizer, num_tokens: int, variant: int) -> list[int]:
    """A deterministic prompt of exactly `num_tokens` real-text tokens; variants differ from the first token."""
    text = " ".join(f"Section {variant}.{i}: the cache keeps keys and values for block {i * 7 % 101}."
                    for i in range(num_tokens))
    return tokenizer.encode(text)[:num_tokens]


class KvreuseSystem:
    name = "kvreuse-fp32"

    def __init__(self):
        config = load_config(None, ["model.dtype=fp32", "cache.enabled=false", "server.max_tokens=8192",
                                    "engine.max_num_batched_tokens=2048", "engine.kv_cache_memory_mb=1024"])
        self.llm = LLM(config)

    def prefill(self, ids: list[int]) -> float:
        return self.llm.generate(ids, SamplingParams(max_tokens=1))[0].ttft_s

    def decode(self, batch: list[list[int]], num_tokens: int) -> float:
        """Seconds spent decoding (after every sequence got its first token)."""
        outs = self.llm.generate(batch, SamplingParams(max_tokens=num_tokens, ignore_eos=True))
        return max(o.total_s for o in outs) - max(o.ttft_s for o in outs)


class HFSystem:
    def __init__(self, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        path = embedded_model_path()
        self.name = f"hf-{'bf16' if dtype == torch.bfloat16 else 'fp32'}"
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> float:
        return timed(lambda: self.model(torch.tensor([ids]), logits_to_keep=1))

    @torch.inference_mode()
    def decode(self, batch: list[list[int]], num_tokens: int) -> float:
        ids = torch.tensor(batch)  # equal lengths: no padding
        kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
        first = timed(lambda: self.model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs))
        total = timed(lambda: self.model.generate(ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                                  **kwargs))
        return total - first


class LlamaCppSystem:
    name = "llama.cpp"

    def __init__(self):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(embedded_model_path()), n_ctx=4096, n_threads=torch.get_num_threads(),
                         n_batch=512, verbose=False)

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        return timed(lambda: self.llm.eval(ids))

    def decode(self, batch: list[list[int]], num_tokens: int) -> float | None:
        if len(batch) != 1:
            return None  # llama-cpp-python serves one sequence per context
        self.llm.reset()
        self.llm.eval(batch[0])

        def run():
            for _ in range(num_tokens - 1):
                self.llm.eval([int(self.llm.sample(top_k=1))])
        return timed(run)


def available_systems(include_bf16: bool) -> list[Callable[[], object]]:
    systems: list[Callable[[], object]] = [KvreuseSystem, lambda: HFSystem(torch.float32)]
    if include_bf16:
        systems.append(lambda: HFSystem(torch.bfloat16))
    if importlib.util.find_spec("llama_cpp") is not None:
        systems.append(LlamaCppSystem)
    return systems


def run(repeats: int = 3, include_bf16: bool = True, progress: Callable[[str], None] = print) -> dict:
    systems = [make() for make in available_systems(include_bf16)]
    tokenizer = systems[0].llm.tokenizer
    results = Interleaved()
    for round_index in range(repeats + 1):  # round 0 warms every system up and is discarded
        for system in systems:
            record = (lambda *a: results.add(*a)) if round_index else (lambda *a: None)
            for length in PREFILL_LENGTHS:
                ids = synthetic_prompt(tokenizer, length, variant=round_index)
                record(system.name, f"prefill_{length}_tok_s", length / system.prefill(ids))
            for batch_size in DECODE_BATCHES:
                batch = [synthetic_prompt(tokenizer, DECODE_PROMPT_LEN, variant=100 * round_index + b)
                         for b in range(batch_size)]
                seconds = system.decode(batch, DECODE_TOKENS)
                if seconds:
                    record(system.name, f"decode_b{batch_size}_tok_s", batch_size * (DECODE_TOKENS - 1) / seconds)
            progress(f"round {round_index}/{repeats}: {system.name} done")
    metrics = [f"prefill_{n}_tok_s" for n in PREFILL_LENGTHS] + [f"decode_b{b}_tok_s" for b in DECODE_BATCHES]
    table = {s.name: {m: results.median(s.name, m) for m in metrics} for s in systems}
    ours = KvreuseSystem.name
    ratios = {f"{m} {ours}/{s.name}": results.ratio(m, ours, s.name)
              for s in systems if s.name != ours for m in metrics}
    b1, b8 = table[ours]["decode_b1_tok_s"], table[ours]["decode_b8_tok_s"]
    ratios[f"decode_b8/decode_b1 {ours}"] = b8 / b1 if b1 and b8 else None
    return {"suite": "engine", "repeats": repeats, "machine": machine(), "medians": table, "ratios": ratios,
            "samples": {f"{s}/{m}": v for (s, m), v in results.samples.items()}}


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}


def markdown(report: dict) -> str:
    metrics = list(next(iter(report["medians"].values())))
    lines = ["| system | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for name, row in report["medians"].items():
        cells = ["-" if row[m] is None else f"{row[m]:.1f}" for m in metrics]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {k}: {v:.2f}x" for k, v in report["ratios"].items() if v]
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run(repeats=1), indent=2))
