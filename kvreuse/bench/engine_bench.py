"""`kvreuse bench engine`: cold prefill and decode throughput against peers on the same weights.

Systems, each with caching off so every prefill is cold: kvreuse (fp32, and bf16), Hugging Face transformers
(fp32 and bf16) on the same GGUF, and llama-cpp-python on the same GGUF when it is installed (`make bench-peers`),
run in a worker process so that a crash is a failed row (llamacpp_peer.py). Runs are interleaved round by round
(A B C A B C ...) and the medians reported, with ratios. At the start, the GEMM peak of each dtype is measured on
the model's own linears (dtype_probe.measure), and each prefill is reported as a fraction of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
from collections.abc import Callable

import torch

from kvreuse.bench.llamacpp_peer import LlamaCppPeer
from kvreuse.bench.timing import Interleaved, timed
from kvreuse.config import load_config
from kvreuse.llm import LLM
from kvreuse.model import dtype_probe
from kvreuse.model.loader import ModelArgs, embedded_model_path
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
    """kvreuse as configured by default (decode compiled, reading the GGUF's own blocks), or with `compile="off"`
    (the `-eager` row: what compiling buys), `weights="dense"` (the `-dense` row: what the GGUF kernel buys),
    or quantized (`-int4`: an approximation; `kvreuse bench quant` prints its fidelity)."""

    def __init__(self, dtype: str = "fp32", quantization: str = "none", compile: str = "decode",
                 weights: str = "auto"):
        self.dtype = dtype
        self.name = "-".join(["kvreuse", dtype, *([quantization] if quantization != "none" else []),
                              *([weights] if weights != "auto" else []), *(["eager"] if compile == "off" else [])])
        config = load_config(None, [f"model.dtype={dtype}", f"model.quantization={quantization}",
                                    f"model.weights={weights}", f"engine.compile={compile}", "cache.enabled=false",
                                    "server.max_tokens=8192",
                                    "engine.max_num_batched_tokens=2048", "engine.kv_cache_memory_mb=1024"])
        self.llm = LLM(config)
        self.llm.wait_compiled()

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
        self.dtype = "bf16" if dtype == torch.bfloat16 else "fp32"
        self.name = f"hf-{self.dtype}"
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


def available_systems(include_bf16: bool) -> list[Callable[[], object]]:
    systems: list[Callable[[], object]] = [KvreuseSystem, lambda: KvreuseSystem(compile="off"),
                                           lambda: KvreuseSystem(weights="dense"),
                                           lambda: KvreuseSystem(quantization="int4"), lambda: HFSystem(torch.float32)]
    if include_bf16:
        systems += [lambda: KvreuseSystem("bf16"), lambda: HFSystem(torch.bfloat16)]
    if importlib.util.find_spec("llama_cpp") is not None:
        systems.append(lambda: LlamaCppPeer(torch.get_num_threads()))
    return systems


def gemm_peak(args: ModelArgs) -> dict[str, float]:
    """FLOP/s of one decoder layer's linears (the model's shapes), prefill-shaped, per dtype: what a prefill can reach
    at most on this machine."""
    shapes = dtype_probe.layer_shapes(args)
    tokens = dtype_probe.prefill_tokens(shapes)
    figures = dtype_probe.measure(shapes, tokens)
    flops = dtype_probe.flops_per_token(shapes) * tokens
    return {"fp32": flops / figures.fp32_prefill_s, "bf16": flops / figures.bf16_prefill_s}


def prefill_flops_per_token(args: ModelArgs) -> float:
    """The linears' FLOPs per prefill token (every layer; attention's own work and the one LM-head row left out)."""
    return dtype_probe.flops_per_token(dtype_probe.layer_shapes(args)) * args.num_layers


def run(repeats: int = 3, include_bf16: bool = True, progress: Callable[[str], None] = print) -> dict:
    systems = [make() for make in available_systems(include_bf16)]
    tokenizer = systems[0].llm.tokenizer
    model_args = systems[0].llm.engine.front_end.model_args
    peak = gemm_peak(model_args)
    progress("GEMM peak on the model's linears: " + ", ".join(f"{d} {v / 1e9:.0f} GFLOP/s" for d, v in peak.items()))
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
            progress(f"round {round_index}/{repeats}: {system.name} done"
                     + (f" (failed: {system.failure})" if getattr(system, "failure", None) else ""))
    for system in systems:
        if hasattr(system, "close"):
            system.close()
    metrics = [f"prefill_{n}_tok_s" for n in PREFILL_LENGTHS] + [f"decode_b{b}_tok_s" for b in DECODE_BATCHES]
    table = {s.name: {m: results.median(s.name, m) for m in metrics} for s in systems}
    ratios = {}
    for ours in (s.name for s in systems if s.name.startswith("kvreuse") and not s.name.endswith("-eager")):
        ratios.update({f"{m} {ours}/{s.name}": results.ratio(m, ours, s.name)
                       for s in systems if not s.name.startswith("kvreuse") for m in metrics})
        b1, b8 = table[ours]["decode_b1_tok_s"], table[ours]["decode_b8_tok_s"]
        ratios[f"decode_b8/decode_b1 {ours}"] = b8 / b1 if b1 and b8 else None
        if ours == "kvreuse-fp32" and "kvreuse-fp32-dense" in table:
            ratios.update({f"{m} {ours}/kvreuse-fp32-dense": results.ratio(m, ours, "kvreuse-fp32-dense")
                           for m in metrics})
        if f"{ours}-eager" in table:
            ratios.update({f"{m} {ours}/{ours}-eager": results.ratio(m, ours, f"{ours}-eager")
                           for m in metrics if m.startswith("decode")})
    flops = prefill_flops_per_token(model_args)
    of_peak = {s.name: {n: (table[s.name][f"prefill_{n}_tok_s"] or 0) * flops / peak[s.dtype] for n in PREFILL_LENGTHS}
               for s in systems if getattr(s, "dtype", None) in peak}
    failures = {s.name: s.failure for s in systems if getattr(s, "failure", None)}
    return {"suite": "engine", "repeats": repeats, "machine": machine(), "medians": table, "ratios": ratios,
            "gemm_peak_flops": peak, "prefill_fraction_of_peak": of_peak, "failures": failures,
            "samples": {f"{s}/{m}": v for (s, m), v in results.samples.items()}}


def machine() -> dict:
    """The CPU (model string and the flags that decide GEMM speed) and the software, printed beside every table."""
    return {**dtype_probe.cpu_identity(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


def markdown(report: dict) -> str:
    metrics = list(next(iter(report["medians"].values())))
    lines = ["| system | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    failures = report.get("failures", {})
    for name, row in report["medians"].items():
        cells = ["-" if row[m] is None else f"{row[m]:.1f}" for m in metrics]
        lines.append(f"| {name}{' (failed: ' + failures[name] + ')' if name in failures else ''} | "
                     + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {k}: {v:.2f}x" for k, v in report["ratios"].items() if v]
    peak = report.get("gemm_peak_flops")
    if peak:
        lines.append("- GEMM peak on the model's linears: "
                     + ", ".join(f"{d} {v / 1e9:.0f} GFLOP/s" for d, v in peak.items()))
        lines += [f"- {name} prefill at " + ", ".join(f"{f:.0%} ({n} tokens)" for n, f in fractions.items())
                  + " of its dtype's GEMM peak" for name, fractions in report["prefill_fraction_of_peak"].items()]
    m = report["machine"]
    lines.append(f"- CPU: {m['cpu']} (flags: {', '.join(m.get('flags', [])) or 'none'}), {m['torch_threads']} "
                 f"torch threads, torch {m['torch']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run(repeats=1), indent=2))
