"""`kvreuse bench scenario [chat eval agent rag prefix]`: the article's scenarios in every cache mode, one process.

Each scenario runs under its own engine config (its preset, by default). Modes: no-cache (every prompt
computed), prefix (exact prefix caching), shift and blend (prefix + segment reuse), blend-noguard where the
config's guard is on, and blend-warm on RAG (blend after its documents were warmed, untimed, as `POST
/cache/warm` or `kvreuse cache warm` would, each as a query's first document: `workloads.rag_corpus`); then the
peers: HF transformers on the same weights without reuse ("hf") and, on chat,
with its own prefix reuse through a copied cache ("hf-prefix"). On a model with sliding-window layers (Gemma 3) the
modes run on two engines of one memory budget: no-cache and prefix where the pool keeps only what the windows read
(`cache.sliding_kv = window`, segment reuse off), and prefix-swa-full, shift and blend where it keeps every layer's
K/V (`full`, which segment reuse needs); each row says its layout, the pool's capacity and how many sequences of the
scenario's mean length it holds at once. Each mode starts from an empty cache and keeps
`concurrency` requests in flight, sent in workload order (so later requests can reuse earlier KV). Fidelity
is measured against the no-cache run of the same requests. Keys follow `vllm bench serve` where it has one
(mean_ttft_ms, p99_ttft_ms, request_throughput, ...); each row also carries its ratios to no-cache (TTFT,
throughput) and to prefix (prefill work), the numbers the targets are stated in."""

from __future__ import annotations

import time
from collections.abc import Callable

from tqdm import tqdm

from kvreuse.bench import workloads
from kvreuse.bench.fidelity import reuse_settings
from kvreuse.bench.metrics import fidelity_metrics, reuse_metrics, serving_metrics
from kvreuse.config import Config
from kvreuse.engine.stats import EngineStats, peak_rss_bytes
from kvreuse.kvcache.layout import KVLayout
from kvreuse.llm import LLM
from kvreuse.sampling_params import SamplingParams
from kvreuse.weights.loader import load_model_info

SCENARIOS = tuple(workloads.WORKLOADS)
# cache.suffix.* per mode; no-cache differs from prefix by sending every request with use_cache=False.
MODES = {
    "no-cache": {"enabled": False},
    "prefix": {"enabled": False},
    "prefix-swa-full": {"enabled": False},
    "shift": {"enabled": True, "mode": "shift"},
    "blend": {"enabled": True, "mode": "blend"},
    "blend-noguard": {"enabled": True, "mode": "blend", "guard_margin": 0.0},
    "blend-warm": {"enabled": True, "mode": "blend"},
}
# The corpus a deployment of the scenario would warm before serving (mode blend-warm).
WARM_CORPUS = {"rag": workloads.rag_corpus}
PEER_SCENARIOS = {"hf": SCENARIOS, "hf-prefix": ("chat",)}
# Requests in flight by default: chat turns and agent steps wait for the previous reply; an eval run is a batch
# job, submitted as a whole (16 = engine.max_num_seqs, what the engine batches); RAG queries and shared-prefix
# groups come one at a time here, so each can reuse the ones before it.
SCENARIO_CONCURRENCY = {"chat": 1, "eval": 16, "agent": 1, "rag": 1, "prefix": 1}
# The pool layout each mode runs on, for a model with sliding-window layers (`layout_configs`).
MODE_LAYOUT = {"no-cache": "window", "prefix": "window"}


def layout_configs(config: Config) -> dict[str, Config]:
    """The engines a scenario's modes run on, by `cache.sliding_kv`: just `config` ("full"), unless its model has
    sliding-window layers: then also one keeping only what the windows read ("window"), segment reuse off."""
    args = load_model_info(config.model.path or None).args
    if not KVLayout.of(args).is_grouped:
        return {"full": config}
    window = config.cache.model_copy(update={"sliding_kv": "window", "suffix": config.cache.suffix.model_copy(
        update={"enabled": False})})
    full = config.cache.model_copy(update={"sliding_kv": "full"})
    return {"window": config.model_copy(update={"cache": window}), "full": config.model_copy(update={"cache": full})}


def pool_metrics(llm: LLM, outputs: list) -> dict:
    """The pool's layout and capacity, and how many sequences of the outputs' mean length (prompt + completion) it
    holds at once, as a decoding sequence holds them (the most a fixed memory budget runs)."""
    front = llm.engine.front_end
    layout, bs = front.kv_layout, front.block_size
    mean_tokens = round(sum(o.usage.prompt_tokens + o.usage.completion_tokens for o in outputs) / len(outputs))
    return {"kv_layout": "window" if layout.is_grouped else "full", "kv_pool_bytes": front.num_kv_blocks *
            front.bytes_per_block, "kv_capacity_tokens": front.kv_capacity_tokens,
            "sequences_at_budget": front.num_kv_blocks // layout.max_blocks_of(mean_tokens, bs, 1)}


def send_all(llm: LLM, conversations: list[list[dict]], params: SamplingParams, use_cache: bool, concurrency: int,
             bar: tqdm) -> list:
    """Closed loop: at most `concurrency` requests in flight, the next one added as soon as one finishes;
    assistant turns carry the replies given (LiveReplies)."""
    engine, pending, in_flight, seqs = llm.engine, list(reversed(conversations)), {}, []
    replies = workloads.LiveReplies()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            messages = pending.pop()
            prompt = engine.front_end.tokenize_chat(replies.fill(messages))
            seq = engine.add_request(prompt, params, use_cache=use_cache)
            seqs.append(seq)
            in_flight[seq.request_id] = messages
        for seq in engine.step():
            if seq.is_finished:
                replies.record(in_flight.pop(seq.request_id), seq.detokenized.text)
                bar.update(1)
    return [engine.output(seq) for seq in seqs]


def run_mode(llm: LLM, conversations: list[list[dict]], mode: str, max_tokens: int, exact: list | None,
             concurrency: int = 1, bar: tqdm | None = None, warm: list[list[dict]] = ()) -> tuple[dict, list]:
    """One mode from an empty cache; the `warm` conversations are computed first, untimed and outside the stats."""
    engine = llm.engine
    engine.kv_manager.pool.reset_cache()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, keep_first_logits=True)
    with reuse_settings(llm, **MODES[mode]):
        warm_start = time.perf_counter()
        if warm:
            llm.chat(list(warm), SamplingParams(max_tokens=1))
        warm_s = time.perf_counter() - warm_start
        engine.stats = EngineStats()
        start = time.perf_counter()
        outputs = send_all(llm, conversations, params, mode != "no-cache", concurrency, bar or tqdm(disable=True))
    duration = time.perf_counter() - start
    reuse = engine.stats.reuse
    result = {
        **serving_metrics([o.ttft_s for o in outputs], [o.total_s for o in outputs],
                          [o.usage.completion_tokens for o in outputs], duration, reuse.prompt_tokens),
        **reuse_metrics(reuse),
        "peak_kv_bytes": engine.stats_snapshot().peak_kv_bytes_in_use, "peak_rss_bytes": peak_rss_bytes(),
    }
    if warm:
        result["warm_s"] = warm_s
    if exact is not None:
        result.update(fidelity_metrics(outputs, exact))
    return result, outputs


def add_ratios(results: dict[str, dict]) -> None:
    """Each row's TTFT and throughput relative to no-cache and prefill work relative to prefix (in place)."""
    base, prefix = results["no-cache"], results.get("prefix")
    for r in results.values():
        r["ttft_vs_no_cache"] = r["mean_ttft_ms"] / base["mean_ttft_ms"]
        r["throughput_vs_no_cache"] = r["request_throughput"] / base["request_throughput"]
        r["work_vs_prefix"] = r["prefill_tokens_computed"] / prefix["prefill_tokens_computed"] if prefix else None


def run(configs: dict[str, Config], num_requests: int, max_tokens: int, concurrency: int | None = None,
        peers: bool = True, progress: Callable[[str], None] = print) -> dict:
    """Every scenario of `configs` (scenario -> the engine config it runs under) in every mode, then its peers.
    `concurrency` None takes each scenario's own (SCENARIO_CONCURRENCY)."""
    report = {"suite": "scenario", "requests": num_requests, "max_tokens": max_tokens, "scenarios": {}, "configs": {}}
    hf = None
    for scenario, config in configs.items():
        llms = {name: LLM(c) for name, c in layout_configs(config).items()}
        for each in llms.values():
            each.wait_compiled()
        llm = llms["full"]
        if peers and hf is None:
            from kvreuse.bench.peers import HFPeer

            hf = HFPeer(config.model.path or None, llm.engine.dtype, str(llm.engine.device))
        report |= {"model": config.model.path or "SmolLM2-135M-Instruct (embedded GGUF)",
                   "device": str(llm.engine.device), "dtype": str(llm.engine.dtype).removeprefix("torch.")}
        in_flight = concurrency or SCENARIO_CONCURRENCY[scenario]
        report["configs"][scenario] = {"preset": config.cache.preset, "block_size": config.cache.block_size,
                                       "policy": config.cache.policy, "normalize_input": config.cache.normalize_input,
                                       "suffix": config.cache.suffix.model_dump(), "concurrency": in_flight}
        conversations = workloads.WORKLOADS[scenario](num_requests)
        # One untimed request first, so no mode pays for first-call allocations and kernel selection.
        for each in llms.values():
            each.chat(conversations[0], SamplingParams(max_tokens=2), use_cache=False)
        if hf is not None:
            hf.run(conversations[:1], 2)
        # With the guard on, blend-noguard shows what the guard costs and what it buys.
        noguard = ["blend-noguard"] if config.cache.suffix.guard_margin > 0 else []
        warmed = ["blend-warm"] if scenario in WARM_CORPUS else []
        swa_full = ["prefix-swa-full"] if "window" in llms else []
        runs = ["no-cache", "prefix"] + swa_full + ["shift", "blend"] + noguard + warmed + [
            p for p, where in PEER_SCENARIOS.items() if hf is not None and scenario in where]
        results, exact = {}, None
        for mode in runs:
            with tqdm(total=len(conversations), desc=f"{scenario}/{mode}", unit="req", leave=False,
                      disable=None) as bar:  # no bar when stderr is not a terminal
                if mode in MODES:  # our engine
                    warm = WARM_CORPUS[scenario]() if mode == "blend-warm" else ()
                    engine_llm = llms.get(MODE_LAYOUT.get(mode, "full"), llm)
                    results[mode], outputs = run_mode(engine_llm, conversations, mode, max_tokens, exact, in_flight,
                                                      bar, warm)
                    results[mode]["pool"] = pool_metrics(engine_llm, outputs)  # the engine's own: no peer has one
                else:
                    # HF sees the text our engine sees (normalize_input rewrites message contents).
                    normalize = llm.engine.front_end.normalize
                    texts = [[{**m, "content": normalize(m["content"])} for m in c] for c in conversations]
                    results[mode], outputs = hf.run(texts, max_tokens, prefix_reuse=mode == "hf-prefix", exact=exact)
            exact = exact or outputs  # no-cache runs first: the exact reference for the others
            progress(f"{scenario} / {mode}: mean TTFT {results[mode]['mean_ttft_ms']:.0f} ms, "
                     f"prefill {results[mode]['prefill_tokens_computed']} tokens")
        add_ratios(results)
        report["scenarios"][scenario] = results
        del llm, llms  # one scenario's engines (and their KV pools) at a time
    return report


def markdown(report: dict) -> str:
    lines = ["| scenario | mode | mean TTFT ms | p99 TTFT ms | TTFT / no-cache | mean TPOT ms | prefill work | "
             "work / prefix | exact hits | approx. hits | req/s | req/s / no-cache | top-1 | mean KL |",
             "|---" * 14 + "|"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for scenario, modes in report["scenarios"].items():
        for mode, r in modes.items():
            lines.append(f"| {scenario} | {mode} | {r['mean_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
                         f"{r['ttft_vs_no_cache']:.2f} | {fmt(r['mean_tpot_ms'], '.1f')} | "
                         f"{r['prefill_tokens_computed']} | {fmt(r['work_vs_prefix'], '.2f')} | "
                         f"{r['exact_hit_rate']:.1%} | {r['approximate_hit_rate']:.1%} | "
                         f"{r['request_throughput']:.2f} | {r['throughput_vs_no_cache']:.2f} | "
                         f"{fmt(r.get('top1_agreement'), '.2f')} | {fmt(r.get('mean_kl'), '.4f')} |")
    rows = [(scenario, mode, r) for scenario, modes in report["scenarios"].items() for mode, r in modes.items()
            if "pool" in r]
    if any(r["pool"]["kv_layout"] == "window" for _, _, r in rows):  # a sliding-window model: what each layout holds
        lines += ["", "| scenario | mode | KV layout | exact hits | mean TTFT ms | peak KV MB | pool capacity, tokens "
                  "| sequences at the budget |", "|---" * 8 + "|"]
        lines += [f"| {scenario} | {mode} | {r['pool']['kv_layout']} | {r['exact_hit_rate']:.1%} | "
                  f"{r['mean_ttft_ms']:.0f} | {r['peak_kv_bytes'] / 2**20:.1f} | {r['pool']['kv_capacity_tokens']} | "
                  f"{r['pool']['sequences_at_budget']} |"
                  for scenario, mode, r in rows]
    return "\n".join(lines)
