"""`kvreuse bench --scenario chat|eval|agent|rag|all`: the seed's scenarios in four cache modes, one process.

Modes: no-cache (every prompt computed), prefix (exact prefix caching), shift and blend (prefix + segment
reuse). Each mode starts from an empty cache and sends the scenario's requests one after another (so later
requests can reuse earlier KV). Fidelity is measured against the no-cache run of the same requests.
Keys follow `vllm bench serve` where it has one (mean_ttft_ms, p99_ttft_ms, request_throughput, ...).
"""

from __future__ import annotations

import statistics
import time

from kvreuse.bench import workloads
from kvreuse.bench.fidelity import kl_divergence, match_length, suffix_settings
from kvreuse.config import Config
from kvreuse.engine.stats import EngineStats, peak_rss_bytes
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams

SCENARIOS = ("chat", "eval", "agent", "rag")
# cache.suffix.* per mode; no-cache differs from prefix by sending every request with use_cache=False.
MODES = {
    "no-cache": {"enabled": False},
    "prefix": {"enabled": False},
    "shift": {"enabled": True, "mode": "shift"},
    "blend": {"enabled": True, "mode": "blend"},
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run_mode(llm: LLM, conversations: list[list[dict]], mode: str, max_tokens: int, exact: list | None) -> dict:
    engine = llm.engine
    engine.kv_manager.pool.reset_cache()
    engine.stats = EngineStats()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, keep_first_logits=True)
    start = time.perf_counter()
    with suffix_settings(llm, **MODES[mode]):
        outputs = [llm.chat(messages, params, use_cache=mode != "no-cache")[0] for messages in conversations]
    duration = time.perf_counter() - start
    ttfts = [o.ttft_s * 1000 for o in outputs]
    tpots = [(o.total_s - o.ttft_s) * 1000 / (o.usage.completion_tokens - 1) for o in outputs
             if o.usage.completion_tokens > 1]
    stats = engine.stats_snapshot()
    total_in, total_out = stats["prompt_tokens"], stats["completion_tokens"]
    result = {
        "completed": len(outputs), "duration": duration,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(outputs) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "mean_ttft_ms": statistics.mean(ttfts), "median_ttft_ms": statistics.median(ttfts),
        "p99_ttft_ms": percentile(ttfts, 99),
        "mean_tpot_ms": statistics.mean(tpots) if tpots else None,
        "p99_tpot_ms": percentile(tpots, 99) if tpots else None,
        "prefill_tokens_computed": stats["prefill_work_tokens"],
        "exact_hit_rate": stats["hit_rate"], "approximate_hit_rate": stats["approximate_hit_rate"],
        "guarded_requests": stats["guarded_requests"],
        "peak_kv_bytes": stats["peak_kv_bytes_in_use"], "peak_rss_bytes": peak_rss_bytes(),
    }
    if exact is not None:
        result["top1_agreement"] = statistics.mean(
            int(o.first_logits.argmax() == e.first_logits.argmax()) for o, e in zip(outputs, exact, strict=True))
        result["mean_kl"] = statistics.mean(
            kl_divergence(e.first_logits, o.first_logits) for o, e in zip(outputs, exact, strict=True))
        result["mean_match_len"] = statistics.mean(
            match_length(e.token_ids, o.token_ids) for o, e in zip(outputs, exact, strict=True))
    return result, outputs


def run(config: Config, scenarios: list[str], num_requests: int, max_tokens: int, progress=print) -> dict:
    llm = LLM(config)
    report = {"suite": "scenario", "requests": num_requests, "max_tokens": max_tokens,
              "block_size": config.cache.block_size, "scenarios": {}}
    for scenario in scenarios:
        conversations = workloads.WORKLOADS[scenario](num_requests)
        results, exact = {}, None
        for mode in MODES:
            results[mode], outputs = run_mode(llm, conversations, mode, max_tokens, exact)
            exact = exact or outputs  # no-cache runs first: the exact reference for the others
            progress(f"{scenario} / {mode}: mean TTFT {results[mode]['mean_ttft_ms']:.0f} ms, "
                     f"prefill {results[mode]['prefill_tokens_computed']} tokens")
        report["scenarios"][scenario] = results
    return report


def markdown(report: dict) -> str:
    lines = ["| scenario | mode | mean TTFT ms | p99 TTFT ms | mean TPOT ms | prefill tokens | exact hits | "
             "approx. hits | req/s | top-1 | mean KL |", "|---" * 11 + "|"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for scenario, modes in report["scenarios"].items():
        for mode, r in modes.items():
            lines.append(f"| {scenario} | {mode} | {r['mean_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
                         f"{fmt(r['mean_tpot_ms'], '.1f')} | {r['prefill_tokens_computed']} | "
                         f"{r['exact_hit_rate']:.1%} | {r['approximate_hit_rate']:.1%} | "
                         f"{r['request_throughput']:.2f} | {fmt(r.get('top1_agreement'), '.2f')} | "
                         f"{fmt(r.get('mean_kl'), '.4f')} |")
    return "\n".join(lines)
