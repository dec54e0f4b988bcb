"""PNG plots for `kvreuse bench scenario`: TTFT per cache mode per scenario, and hit rate against block_size; and
for `kvreuse bench trace`, hit rate against cache capacity per eviction policy.

The TTFT chart draws a scenario report as it is (any mode names, including peers such as "hf"). The hit-rate
sweep runs no model: like `kvreuse analyze`, it replays each scenario's prompts through the real cache manager,
once per block size, and counts the prompt tokens that exact prefix matching, and then segment reuse, would
serve from the cache. Figures are drawn on matplotlib's Agg canvas through its object API, never through
pyplot, so importing this module changes no global backend or figure state.
"""

from __future__ import annotations

from pathlib import Path

from kvreuse.analyze import load_tokenizer, tokenize
from kvreuse.bench import workloads
from kvreuse.config import Config
from kvreuse.extras import PLOTS, require
from kvreuse.kvcache.simulate import simulate

FigureCanvasAgg = require("matplotlib.backends.backend_agg", "bench", PLOTS).FigureCanvasAgg
Figure = require("matplotlib.figure", "bench", PLOTS).Figure

TTFT_PNG = "scenario_ttft.png"
HIT_RATE_PNG = "hit_rate_vs_block_size.png"
DEFAULT_BLOCK_SIZES = (8, 16, 32, 64, 128)


def _colour(index: int) -> str:
    return f"C{index % 10}"


def _save(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)  # attaches itself to the figure; savefig then renders with Agg whatever pyplot uses
    fig.savefig(path, format="png", dpi=120)
    return path


def ttft_plot(report: dict, path) -> Path:
    """Grouped bars of mean TTFT (ms) per scenario (x) and mode (one bar each), with a whisker up to p99 TTFT.

    `report` is a `kvreuse bench scenario` report: {"scenarios": {scenario: {mode: result}}, ...} where a
    result has mean_ttft_ms and p99_ttft_ms. Modes are taken in first-seen order; a mode missing from a
    scenario leaves a gap. Returns the PNG's path.
    """
    scenarios = list(report.get("scenarios", {}))
    modes: list[str] = []
    for results in report.get("scenarios", {}).values():
        modes += [m for m in results if m not in modes]
    fig = Figure(figsize=(max(6.0, 1.2 + len(scenarios) * (0.35 * len(modes) + 0.6)), 4.8), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        xs, means, whiskers = [], [], []
        for j, scenario in enumerate(scenarios):
            result = report["scenarios"][scenario].get(mode) or {}
            mean = result.get("mean_ttft_ms")
            if mean is None:
                continue
            p99 = result.get("p99_ttft_ms")
            xs.append(j - 0.4 + width * (i + 0.5))
            means.append(mean)
            whiskers.append(max(0.0, p99 - mean) if p99 is not None else 0.0)
        if xs:
            ax.bar(xs, means, width, label=mode, color=_colour(i), yerr=[[0.0] * len(xs), whiskers],
                   error_kw={"capsize": 3, "elinewidth": 1, "ecolor": "0.25"})
    ax.set_xticks(range(len(scenarios)), scenarios)
    ax.set_xlabel("scenario")
    ax.set_ylabel("mean TTFT (ms); whisker: p99")
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    details = [str(report[k]) for k in ("model", "device") if report.get(k)]
    if report.get("requests"):
        details.append(f"{report['requests']} requests" + (f" x {report['max_tokens']} tokens"
                                                           if report.get("max_tokens") else ""))
    if report.get("block_size"):
        details.append(f"block_size {report['block_size']}")
    ax.set_title("Time to first token by scenario and cache mode" + (f"\n{', '.join(details)}" if details else ""))
    if modes:
        ax.legend(title="mode", fontsize="small")
    return _save(fig, path)


def block_size_sweep(scenarios: list[str], block_sizes: list[int], num_requests: int,
                     config: Config | None = None) -> dict:
    """The share of prompt tokens each scenario's prompts would take from the cache at each block size, found
    by replaying them through the cache manager (no model run; generated tokens are not cached).

    Returns {"requests": n, "block_sizes": [...], "scenarios": {name: {"exact": [...], "segment": [...],
    "with_segments": [...]}}}, each list aligned with block_sizes and in [0, 1]: "exact" is the exact prefix hit
    rate with segment reuse off; with it on, "segment" is the share served by reused segments and
    "with_segments" the whole share (exact + segment; its exact part can fall below "exact", since the blocks
    after an approximate segment are not cached as exact prefix).
    `config` (default: defaults) chooses the model's tokenizer, normalize_input and the cache settings other
    than block_size.
    """
    unknown = [s for s in scenarios if s not in workloads.WORKLOADS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {sorted(workloads.WORKLOADS)}")
    if any(b < 1 for b in block_sizes):
        raise ValueError(f"block sizes must be positive, got {block_sizes}")
    config = config or Config()
    tokenizer, fingerprint = load_tokenizer(config)
    # The engine sizes its pool from a memory budget, so smaller blocks mean more of them: hold the capacity in
    # tokens fixed at the configured block size's (4096 blocks when unset, as analyze assumes), so the curves
    # show the block grid and not the pool size.
    capacity_tokens = (config.engine.num_kv_blocks or 4096) * config.cache.block_size
    cached_tokens = config.cache.max_blocks * config.cache.block_size
    sweep = {"requests": num_requests, "block_sizes": list(block_sizes), "scenarios": {}}
    for name in scenarios:
        token_lists = [tokenize(tokenizer, p, config.cache.normalize_input)
                       for p in workloads.WORKLOADS[name](num_requests)]
        rates: dict[str, list[float]] = {"exact": [], "segment": [], "with_segments": []}
        for block_size in block_sizes:
            cache = config.cache.with_changes(block_size=block_size, max_blocks=cached_tokens // block_size)
            num_blocks = max(1, capacity_tokens // block_size)
            exact = simulate(token_lists, cache, fingerprint, num_blocks, enable_segments=False)
            both = simulate(token_lists, cache, fingerprint, num_blocks, enable_segments=True)
            rates["exact"].append(exact.hit_rate)
            rates["segment"].append(both.approximate_hit_rate)
            rates["with_segments"].append(both.hit_rate + both.approximate_hit_rate)
        sweep["scenarios"][name] = rates
    return sweep


def hit_rate_plot(sweep: dict, path) -> Path:
    """Hit rate (% of prompt tokens) against block_size on a log2 axis, one colour per scenario: solid for exact
    prefix hits, dashed for exact + segment reuse. `sweep` is what block_size_sweep returns. Returns the path."""
    block_sizes = sweep["block_sizes"]
    fig = Figure(figsize=(9.0, 4.8), layout="constrained")
    ax = fig.add_subplot()
    for i, (name, rates) in enumerate(sweep["scenarios"].items()):
        exact = rates["exact"]
        total = rates.get("with_segments") or [e + s for e, s in zip(exact, rates["segment"], strict=True)]
        ax.plot(block_sizes, [100 * r for r in exact], color=_colour(i), marker="o", label=f"{name}: exact prefix")
        ax.plot(block_sizes, [100 * r for r in total], color=_colour(i), marker="s", linestyle="--",
                label=f"{name}: + segment reuse")
    ax.set_xscale("log", base=2)
    ax.set_xticks(block_sizes, [str(b) for b in block_sizes])
    ax.minorticks_off()  # log-axis minor ticks would fall between the block sizes, which are the only values
    ax.set_xlabel("cache.block_size (tokens)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    requests = f"{sweep['requests']} requests per scenario, " if sweep.get("requests") else ""
    ax.set_title(f"Hit rate against block size\n{requests}cache replay without running the model")
    if sweep["scenarios"]:
        fig.legend(loc="outside right upper", fontsize="small")  # outside: the curves fill the whole 0-100 range
    return _save(fig, path)


def capacity_plot(report: dict, path) -> Path:
    """Hit rate (% of prompt tokens) against capacity (hash blocks, log axis), one line per policy, the infinite
    cache as a dashed line. `report` is what `trace_bench.run` returns. Returns the PNG's path."""
    capacities = report["capacities"]
    by = {(r["capacity"], r["policy"]): r["hit_rate"] for r in report["results"]}
    fig = Figure(figsize=(8.0, 4.8), layout="constrained")
    ax = fig.add_subplot()
    for i, policy in enumerate(report["policies"]):
        ax.plot(capacities, [100 * by[c, policy] for c in capacities], color=_colour(i), marker="o", label=policy,
                linestyle=":" if policy == "belady" else "-")
    ax.axhline(100 * report["infinite"]["hit_rate"], color="0.4", linestyle="--", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xticks(capacities, [f"{c:,}" for c in capacities])
    ax.minorticks_off()
    ax.set_xlabel(f"capacity (hash blocks of {report['hash_block_tokens']} trace tokens)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title(f"Prefix hit rate against capacity: {report['trace'] or 'trace'}\n{report['requests']} requests, "
                 f"{report['tokens_per_hash']} tokens per hash, replayed through the cache manager")
    ax.legend(title="policy", fontsize="small", loc="upper left", ncols=2)
    return _save(fig, path)


def write_plots(report: dict, sweep: dict | None, out_dir) -> list[Path]:
    """Write scenario_ttft.png (from `report`) and, if `sweep` is given, hit_rate_vs_block_size.png into
    `out_dir`; returns the paths written."""
    out_dir = Path(out_dir)
    paths = [ttft_plot(report, out_dir / TTFT_PNG)]
    if sweep is not None:
        paths.append(hit_rate_plot(sweep, out_dir / HIT_RATE_PNG))
    return paths
