"""`kvreuse bench engine`: cold prefill and decode throughput against peers on the same weights.

Systems, each with caching off so every prefill is cold: kvreuse (fp32, and bf16), Hugging Face transformers
(fp32 and bf16) on the same weights, and llama-cpp-python on the same GGUF when it is installed
(`make bench-peers`), run in a worker process so that a crash is a failed row (llamacpp_peer.py). Runs are
interleaved round by round (A B C A B C ...) and the medians reported, with ratios. At the start, the GEMM peak of
each dtype is measured on the model's own linears, on the device the systems run on, and each prefill is reported
as a fraction of it. `Sizes` says what is timed; `SYSTEMS` names every system a run may choose.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from kvreuse.bench.device_timing import gemm_seconds, timed_on
from kvreuse.bench.engine_sizes import Sizes
from kvreuse.bench.llamacpp_peer import LlamaCppPeer
from kvreuse.bench.timing import Interleaved
from kvreuse.config import load_config
from kvreuse.engine.resolved_model import resolve_device
from kvreuse.kvcache.layout import resolve_layout
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams
from kvreuse.tuning import dtype_probe
from kvreuse.weights.loader import ModelArgs, load_model_info, resolve_model_path


@dataclass(frozen=True)
class Target:
    """The weights (None: the embedded model), the device (`model.device`: auto, cpu, cuda) and the sizes."""
    model: str | None = None
    device: str = "auto"
    sizes: Sizes = Sizes()


def synthetic_prompt(tokenizer, num_tokens: int, variant: int) -> list[int]:
    """A deterministic prompt of exactly `num_tokens` real-text tokens; variants differ from the first token."""
    text = " ".join(f"Section {variant}.{i}: the cache keeps keys and values for block {i * 7 % 101}."
                    for i in range(num_tokens))
    return tokenizer.encode(text)[:num_tokens]


class KvreuseSystem:
    """kvreuse as configured by default (decode compiled, reading the GGUF's own blocks), or with `compile="off"`
    (the `-eager` row: what compiling buys), `weights="dense"` (the `-dense` row: what the GGUF kernel buys),
    or quantized (`-int4`: an approximation; `kvreuse bench quant` prints its fidelity)."""

    def __init__(self, target: Target = Target(), dtype: str = "fp32", quantization: str = "none",
                 compile: str = "decode", weights: str = "auto"):
        self.dtype = dtype
        self.name = "-".join(["kvreuse", dtype, *([quantization] if quantization != "none" else []),
                              *([weights] if weights != "auto" else []), *(["eager"] if compile == "off" else [])])
        model = [f"model.path={target.model}"] if target.model else []
        settings = [*model, f"model.device={target.device}", f"model.dtype={dtype}",
                    f"model.quantization={quantization}", f"model.weights={weights}", f"engine.compile={compile}",
                    "cache.enabled=false"]
        layout = resolve_layout(load_model_info(target.model).args, load_config(None, settings).cache)
        config = load_config(None, [*settings, *target.sizes.engine_settings(layout)])
        self.llm = LLM(config)
        self.llm.wait_compiled()

    def prefill(self, ids: list[int]) -> float:
        return prefill_s(self.llm, ids)

    def decode(self, batch: list[list[int]], num_tokens: int) -> float:
        return decode_s(self.llm, batch, num_tokens)


def prefill_s(llm: LLM, ids: list[int]) -> float:
    """Seconds to the first token of a cold prompt (its whole prefill)."""
    return llm.generate(ids, SamplingParams(max_tokens=1))[0].ttft_s


def decode_s(llm: LLM, batch: list[list[int]], num_tokens: int) -> float:
    """Seconds spent decoding `batch` (after every sequence got its first token)."""
    outs = llm.generate(batch, SamplingParams(max_tokens=num_tokens, ignore_eos=True))
    return max(o.total_s for o in outs) - max(o.ttft_s for o in outs)


class HFSystem:
    def __init__(self, target: Target = Target(), dtype: torch.dtype = torch.float32):
        from kvreuse.bench.peers import load_hf

        self.device = resolve_device(target.device)
        self.dtype = "bf16" if dtype == torch.bfloat16 else "fp32"
        self.name = f"hf-{self.dtype}"
        self.model = load_hf(target.model, dtype, str(self.device))[0]

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> float:
        tensor = torch.tensor([ids], device=self.device)
        return timed_on(self.device, lambda: self.model(tensor, logits_to_keep=1))

    @torch.inference_mode()
    def decode(self, batch: list[list[int]], num_tokens: int) -> float:
        ids = torch.tensor(batch, device=self.device)  # equal lengths: no padding
        kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
        first = timed_on(self.device, lambda: self.model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs))
        total = timed_on(self.device, lambda: self.model.generate(ids, max_new_tokens=num_tokens,
                                                                  min_new_tokens=num_tokens, **kwargs))
        return total - first


# Every system a run may choose, by the name its row carries. "-dense" and "llama.cpp" need a GGUF; "-int4" quantizes
# on any device.
SYSTEMS: dict[str, Callable[[Target], object]] = {
    "kvreuse-fp32": lambda t: KvreuseSystem(t),
    "kvreuse-fp32-eager": lambda t: KvreuseSystem(t, compile="off"),
    "kvreuse-fp32-dense": lambda t: KvreuseSystem(t, weights="dense"),
    "kvreuse-fp32-int4": lambda t: KvreuseSystem(t, quantization="int4"),
    "hf-fp32": lambda t: HFSystem(t, torch.float32),
    "kvreuse-bf16": lambda t: KvreuseSystem(t, "bf16"),
    "kvreuse-bf16-eager": lambda t: KvreuseSystem(t, "bf16", compile="off"),
    "hf-bf16": lambda t: HFSystem(t, torch.bfloat16),
    "llama.cpp": lambda t: LlamaCppPeer(torch.get_num_threads(), model=t.model),
}


def default_systems(target: Target, include_bf16: bool) -> list[str]:
    """The systems a run without `--systems` compares: what the model and the installed peers allow."""
    gguf = resolve_model_path(target.model).suffix == ".gguf"
    names = ["kvreuse-fp32", "kvreuse-fp32-eager", *(["kvreuse-fp32-dense"] if gguf else []), "kvreuse-fp32-int4",
             "hf-fp32"]
    if include_bf16:
        names += ["kvreuse-bf16", "hf-bf16"]
    if gguf and importlib.util.find_spec("llama_cpp") is not None:
        names.append("llama.cpp")
    return names


def gemm_peak(args: ModelArgs, device: torch.device, rows: int) -> dict[str, float]:
    """FLOP/s of one decoder layer's linears (the model's shapes), prefill-shaped, per dtype: what a prefill can reach
    at most on this machine. On a CPU the dtype probe's shapes (up to 512 rows); on another device `rows` rows."""
    shapes = dtype_probe.layer_shapes(args)
    if device.type == "cpu":
        tokens = dtype_probe.prefill_tokens(shapes)
        figures = dtype_probe.measure(shapes, tokens)
        seconds = {"fp32": figures.fp32_prefill_s, "bf16": figures.bf16_prefill_s}
    else:
        tokens = rows
        seconds = {name: gemm_seconds(shapes, rows, dtype, device)
                   for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    flops = dtype_probe.flops_per_token(shapes) * tokens
    return {name: flops / s for name, s in seconds.items()}


def prefill_flops_per_token(args: ModelArgs) -> float:
    """The linears' FLOPs per prefill token (every layer; attention's own work and the one LM-head row left out)."""
    return dtype_probe.flops_per_token(dtype_probe.layer_shapes(args)) * args.num_layers


def _round(systems: list, tokenizer, sizes: Sizes, round_index: int, record: Callable) -> Iterator:
    """One round: every system's prefills, then its decodes, in turn; yields each system once it is done."""
    for system in systems:
        for length in sizes.prefill_lengths:
            ids = synthetic_prompt(tokenizer, length, variant=round_index)
            seconds = system.prefill(ids)
            if seconds:
                record(system.name, f"prefill_{length}_tok_s", length / seconds)
        for batch_size in sizes.decode_batches:
            batch = [synthetic_prompt(tokenizer, sizes.decode_prompt_len, variant=100 * round_index + b)
                     for b in range(batch_size)]
            seconds = system.decode(batch, sizes.decode_tokens)
            if seconds:
                record(system.name, f"decode_b{batch_size}_tok_s", batch_size * (sizes.decode_tokens - 1) / seconds)
        yield system


def run(repeats: int = 3, include_bf16: bool = True, progress: Callable[[str], None] = print,
        target: Target = Target(), systems: list[str] | None = None) -> dict:
    """Every system of `systems` (default: `default_systems`) on `target`, in `repeats` interleaved rounds after one
    warm-up round; the report (medians, ratios, GEMM peak and the machine)."""
    names = systems or default_systems(target, include_bf16)
    if not any(name.startswith("kvreuse") for name in names):
        raise ValueError(f"no kvreuse system among {', '.join(names)}: the bench tokenizes with one")
    made = [SYSTEMS[name](target) for name in names]
    engine = next(s for s in made if isinstance(s, KvreuseSystem)).llm.engine
    tokenizer, model_args, device = engine.front_end.tokenizer, engine.front_end.model_args, engine.device
    peak = gemm_peak(model_args, device, max(target.sizes.prefill_lengths))
    progress("GEMM peak on the model's linears: " + ", ".join(f"{d} {v / 1e9:.0f} GFLOP/s" for d, v in peak.items()))
    results = Interleaved()
    for round_index in range(repeats + 1):  # round 0 warms every system up and is discarded
        record = (lambda *a: results.add(*a)) if round_index else (lambda *a: None)
        for system in _round(made, tokenizer, target.sizes, round_index, record):
            progress(f"round {round_index}/{repeats}: {system.name} done"
                     + (f" (failed: {system.failure})" if getattr(system, "failure", None) else ""))
    for system in made:
        if hasattr(system, "close"):
            system.close()
    return _report(made, results, target, repeats, peak, model_args, device)


def _ratios(table: dict, results: Interleaved, names: list[str], sizes: Sizes) -> dict[str, float | None]:
    metrics, ratios = sizes.metrics(), {}
    low, high = min(sizes.decode_batches), max(sizes.decode_batches)
    for ours in (n for n in names if n.startswith("kvreuse") and not n.endswith("-eager")):
        ratios.update({f"{m} {ours}/{peer}": results.ratio(m, ours, peer)
                       for peer in names if not peer.startswith("kvreuse") for m in metrics})
        if high > low:
            b_low, b_high = table[ours][f"decode_b{low}_tok_s"], table[ours][f"decode_b{high}_tok_s"]
            ratios[f"decode_b{high}/decode_b{low} {ours}"] = b_high / b_low if b_low and b_high else None
        if ours == "kvreuse-fp32" and "kvreuse-fp32-dense" in table:
            ratios.update({f"{m} {ours}/kvreuse-fp32-dense": results.ratio(m, ours, "kvreuse-fp32-dense")
                           for m in metrics})
        if f"{ours}-eager" in table:
            ratios.update({f"{m} {ours}/{ours}-eager": results.ratio(m, ours, f"{ours}-eager")
                           for m in metrics if m.startswith("decode")})
    return ratios


def _report(systems: list, results: Interleaved, target: Target, repeats: int, peak: dict, model_args: ModelArgs,
            device: torch.device) -> dict:
    sizes, names = target.sizes, [s.name for s in systems]
    table = {name: {m: results.median(name, m) for m in sizes.metrics()} for name in names}
    flops = prefill_flops_per_token(model_args)
    of_peak = {s.name: {n: (table[s.name][f"prefill_{n}_tok_s"] or 0) * flops / peak[s.dtype]
                        for n in sizes.prefill_lengths}
               for s in systems if getattr(s, "dtype", None) in peak}
    failures = {s.name: s.failure for s in systems if getattr(s, "failure", None)}
    return {"suite": "engine", "repeats": repeats, "model": target.model or "SmolLM2-135M-Instruct (embedded GGUF)",
            "device": str(device), "sizes": asdict(sizes),
            "machine": machine(device), "medians": table, "ratios": _ratios(table, results, names, sizes),
            "gemm_peak_flops": peak, "prefill_fraction_of_peak": of_peak, "failures": failures,
            "samples": {f"{s}/{m}": v for (s, m), v in results.samples.items()}}


def machine(device: torch.device | None = None) -> dict:
    """The CPU (model string and the flags that decide GEMM speed), the accelerator the systems ran on if any, and
    the software, printed beside every table."""
    info = {**dtype_probe.cpu_identity(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}
    if device is not None and device.type == "cuda":
        info |= {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return info


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
    if m.get("gpu"):
        lines.append(f"- GPU: {m['gpu']} (CUDA {m['cuda']})")
    lines.append(f"- CPU: {m['cpu']} (flags: {', '.join(m.get('flags', [])) or 'none'}), {m['torch_threads']} "
                 f"torch threads, torch {m['torch']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run(repeats=1), indent=2))
