"""`kvreuse bench windows`: which sliding-window blocks should the cache keep? The scenario workloads replayed through
the cache manager over a sliding-window model's grouped pool (kvcache/layout.py), once per window retention
(bench/passed_windows.py) and pool size, beside the same memory under the full layout (`cache.sliding_kv = full`,
llama.cpp's `--swa-full`).

The retentions decide what becomes of the window blocks a running sequence's window has passed:
- "policy" (the default, as this bench measured it best): cached like any other block, under `cache.policy`;
- "cold": cached, but evicted before anything the eviction policy holds, unless a hit reused them;
- "end": freed at once, unless a hit reused them, so only the windows a sequence holds when it ends stay cached.
Under all three a request keeps the windows of hits at its last two block boundaries and at the last two before its
prompt's end, and window blocks go as soon as the full-attention block they are found through goes.
"swa-full" is the reference: every layer's K/V kept for the whole sequence, in blocks holding every layer, so the same
memory holds `capacity x layout.layers_per_block // num_layers` of them (capacity // 6 on Gemma 3 270M, whose grouped
blocks hold 3 of its 18 layers).

Each scenario's conversations are rendered with the chat template and tokenized as the engine tokenizes chat requests
(`Tokenizer.encode_chat`), then go one after another through a `CacheSimulator`: the engine's own KVCacheManager,
block pool and eviction policy, with no model run (generated tokens are not cached). No model runs, so the numbers are
deterministic: the same on any machine; the machine only sets how long the replay takes.

Capacities are in pool blocks of the grouped layout, requests in flight included. By default each scenario gets its
own: multiples (`DEFAULT_MULTIPLES`) of the blocks its largest prompt holds at admission (every group's blocks for the
whole prompt: `len(layout.groups) x ceil(tokens / block_size)`, the least pool that admits it), rounded up to a whole
number of groups, up to the "no pressure" capacity that holds every prompt's blocks at once, where nothing can be
evicted. So every scenario spans heavy pressure (one prompt's worth: each admission evicts nearly everything) to none.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvreuse.bench import workloads
from kvreuse.bench.passed_windows import RETENTIONS, PassedWindows, WindowRetention
from kvreuse.config import CacheConfig
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.kvcache.layout import KVLayout
from kvreuse.kvcache.simulate import CacheSimulator
from kvreuse.model.args import ModelArgs

SWA_FULL = "swa-full"
MODES = (*RETENTIONS, SWA_FULL)
DEFAULT_MODEL = "gemma3-270m"
DEFAULT_SCENARIOS = ("chat", "rag", "prefix", "eval", "agent")
DEFAULT_REQUESTS = 48
DEFAULT_MULTIPLES = (1, 1.5, 2, 3, 4, 6, 8, 12, 16)
NO_PRESSURE = "no pressure"
CHAT_TURNS = 8  # workloads.chat's turns per conversation


def interleaved_chat(num_requests: int) -> list[list[dict]]:
    """`workloads.chat`'s conversations interleaved turn by turn (every conversation's first turn, then every second
    one, ...), as concurrent sessions arrive: other sessions' prompts come between a turn and the next."""
    requests = workloads.chat(num_requests, turns=CHAT_TURNS)
    return [requests[i] for i in sorted(range(len(requests)), key=lambda i: (i % CHAT_TURNS, i // CHAT_TURNS))]


# Beyond the scenario bench's five, not run by default: chat-mixed, the chat sessions interleaved; rag-long, RAG with
# 4-6 documents per query (about 1,100 tokens on Gemma 3, up to 1,300), so that a query's window has passed the
# end of the shared first document before the query ends.
EXTRA_WORKLOADS: dict[str, Callable[[int], list]] = {
    "chat-mixed": interleaved_chat,
    "rag-long": lambda n: workloads.rag(n, docs_per_query=(4, 6)),
}
SCENARIOS = {**workloads.WORKLOADS, **EXTRA_WORKLOADS}
PNG = "window-retention.png"


def tokenize(tokenizer, conversations: Sequence[list[dict] | str]) -> list[list[int]]:
    """Prompt tokens as the engine makes them: a conversation through the chat template (`encode_chat`, which adds
    no BOS beyond the template's own), a plain text with `encode`."""
    return [tokenizer.encode(c) if isinstance(c, str) else tokenizer.encode_chat(tokenizer.render_chat(c))
            for c in conversations]


def scenario_prompts(tokenizer, scenarios: Sequence[str], num_requests: int) -> dict[str, list[list[int]]]:
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}")
    return {name: tokenize(tokenizer, SCENARIOS[name](num_requests)) for name in scenarios}


def admission_blocks(layout: KVLayout, num_tokens: int, block_size: int) -> int:
    """Pool blocks a prompt of `num_tokens` holds when it is admitted whole (the simulator's step): every group's
    blocks for all its tokens, before its passed windows are released."""
    return len(layout.groups) * -(-num_tokens // block_size)


def full_capacity(capacity: int, layout: KVLayout, full: KVLayout) -> int:
    """The full layout's blocks in the memory of `capacity` blocks of `layout`: a block's size is its layers."""
    return capacity * layout.layers_per_block // full.layers_per_block


def default_capacities(token_lists: Sequence[list[int]], layout: KVLayout, block_size: int,
                       multiples: Sequence[float] = DEFAULT_MULTIPLES) -> tuple[list[int], int]:
    """The capacities (sorted, distinct) for these prompts, and the no-pressure one among them (see the module's
    docstring)."""
    groups = len(layout.groups)
    largest = max(admission_blocks(layout, len(t), block_size) for t in token_lists)
    no_pressure = sum(admission_blocks(layout, len(t), block_size) for t in token_lists)
    capacities = {groups * math.ceil(m * largest / groups) for m in multiples}
    return sorted({c for c in capacities if c < no_pressure} | {no_pressure}), no_pressure


def replay(token_lists: Sequence[list[int]], cache: CacheConfig, fingerprint: str, num_blocks: int,
           layout: KVLayout, retention: WindowRetention = "policy") -> dict:
    """The prompts in order through one simulator of `num_blocks` blocks of `layout` (no cap on cached blocks beyond
    the pool) under `retention` (a layout without window groups has nothing to retain); the counts."""
    simulator = CacheSimulator(cache.with_changes(max_blocks=num_blocks), fingerprint, num_blocks,
                               enable_segments=False, layout=layout)
    PassedWindows.install(simulator.manager, retention)
    total = ReuseRecord()
    for token_ids in token_lists:
        total += simulator.run(token_ids)
    return {"pool_blocks": num_blocks, "hit_rate": round(total.hit_rate, 4), "prompt_tokens": total.prompt_tokens,
            "cached_tokens": total.cached_tokens, "computed_tokens": total.computed_prompt_tokens,
            "evictions": simulator.manager.pool.num_evictions, "skipped_requests": simulator.num_skipped}


def machine() -> dict:
    """The CPU and Python the replay ran on (they set its speed, never its numbers)."""
    from kvreuse.tuning.dtype_probe import cpu_identity

    cpu = cpu_identity()
    return {"cpu": cpu["cpu"], "arch": cpu["machine"], "cores": os.cpu_count(), "python": platform.python_version()}


def run(args: ModelArgs, prompts: dict[str, list[list[int]]], fingerprint: str, *, cache: CacheConfig | None = None,
        capacities: Sequence[int] | None = None, multiples: Sequence[float] = DEFAULT_MULTIPLES,
        model: str = "", progress: Callable[[str], None] = lambda line: None, bar=None) -> dict:
    """Every scenario's prompts at every capacity under each retention and the swa-full reference: the report.
    `capacities` (grouped-layout blocks) applies to every scenario; None: each scenario's defaults. `bar`: a tqdm (or
    anything with `update`) advanced once per replay."""
    cache = cache or CacheConfig()
    layout, full = KVLayout.of(args), KVLayout.of(args, keep_window_kv=True)
    if not layout.is_grouped:
        raise ValueError("the model has no grouped layout (it does not mix full-attention and sliding-window "
                         "layers), so there are no window blocks to keep")
    bs = cache.block_size
    report = {"suite": "windows", "model": model, "layout": layout.describe(), "groups": len(layout.groups),
              "layers_per_block": layout.layers_per_block, "full_layers_per_block": full.layers_per_block,
              "windows": sorted({g.window for g in layout.window_groups}), "block_size": bs, "policy": cache.policy,
              "requests": {name: len(t) for name, t in prompts.items()}, "modes": list(MODES),
              "deterministic": True, "machine": machine(), "scenarios": {}}
    start = time.perf_counter()
    for name, token_lists in prompts.items():
        largest = max(admission_blocks(layout, len(t), bs) for t in token_lists)
        if capacities is None:
            chosen, no_pressure = default_capacities(token_lists, layout, bs, multiples)
        else:
            chosen = sorted(set(capacities))
            no_pressure = sum(admission_blocks(layout, len(t), bs) for t in token_lists)
        results = []
        for capacity in chosen:
            for mode in MODES:
                if mode == SWA_FULL:
                    result = replay(token_lists, cache, fingerprint, full_capacity(capacity, layout, full), full)
                else:
                    result = replay(token_lists, cache, fingerprint, capacity, layout, mode)
                results.append({"capacity": capacity, "mode": mode, **result})
                if bar is not None:
                    bar.update(1)
            rates = ", ".join(f"{r['mode']} {r['hit_rate']:.3f}" for r in results[-len(MODES):])
            progress(f"{name} @ {capacity} blocks: {rates}")
        report["scenarios"][name] = {
            "prompt_tokens": sum(map(len, token_lists)), "max_prompt_tokens": max(map(len, token_lists)),
            "largest_prompt_blocks": largest, "no_pressure_blocks": no_pressure, "capacities": chosen,
            "results": results}
        report["scenarios"][name]["shortfalls"] = shortfalls(report["scenarios"][name])
    report["replay_seconds"] = round(time.perf_counter() - start, 2)
    return report


def num_replays(prompts: dict, capacities: Sequence[int] | None, multiples: Sequence[float], args: ModelArgs,
                block_size: int) -> int:
    """How many replays `run` makes (a progress bar's total)."""
    if capacities is not None:
        return len(prompts) * len(set(capacities)) * len(MODES)
    layout = KVLayout.of(args)
    return sum(len(default_capacities(t, layout, block_size, multiples)[0]) for t in prompts.values()) * len(MODES)


def best_modes(rows: dict[str, dict]) -> list[str]:
    best = max(r["cached_tokens"] for r in rows.values())
    return [m for m, r in rows.items() if r["cached_tokens"] == best]


def shortfalls(scenario: dict) -> dict[str, dict]:
    """Per mode, its largest shortfall in exact hit rate against the best mode of the same capacity, and where: the
    capacity and the best mode(s) there (a mode that is never below the best: 0 at its smallest capacity)."""
    worst: dict[str, dict] = {}
    for capacity, rows in _by_capacity(scenario).items():
        best = best_modes(rows)
        top = rows[best[0]]["hit_rate"]
        for mode, row in rows.items():
            gap = round(top - row["hit_rate"], 4)
            if mode not in worst or gap > worst[mode]["points"]:
                worst[mode] = {"points": gap, "capacity": capacity, "best": best, "best_hit_rate": top,
                               "hit_rate": row["hit_rate"]}
    return worst


def _by_capacity(scenario: dict) -> dict[int, dict[str, dict]]:
    table: dict[int, dict[str, dict]] = {}
    for r in scenario["results"]:
        table.setdefault(r["capacity"], {})[r["mode"]] = r
    return table


def _capacity_label(capacity: int, scenario: dict) -> str:
    if capacity == scenario["no_pressure_blocks"]:
        return NO_PRESSURE
    return f"{capacity / scenario['largest_prompt_blocks']:.2g}x"


def markdown(report: dict) -> str:
    """The hit rates (the best of each row in bold), then prefill tokens computed and evictions, per scenario and
    capacity; the setup and the machine."""
    modes = report["modes"]
    windows = ", ".join(map(str, report["windows"]))
    lines = [f"Window retention on {report['model'] or 'the model'} ({report['layout']}), block_size "
             f"{report['block_size']}, cache.policy {report['policy']}. Capacity: pool blocks of "
             f"{report['layers_per_block']} layers (x: multiples of the scenario's largest prompt at admission); "
             f"swa-full gets the same memory in blocks of {report['full_layers_per_block']} layers. Exact prefix hit "
             f"rate = cached prompt tokens / prompt tokens; bold: the best of the row.", "",
             "| scenario | capacity (blocks) | vs largest prompt | " + " | ".join(modes) + " |",
             "|---|---|---|" + "---|" * len(modes)]
    for name, scenario in report["scenarios"].items():
        for capacity, rows in _by_capacity(scenario).items():
            best = best_modes(rows)
            cells = [f"**{rows[m]['hit_rate']:.3f}**" if m in best else f"{rows[m]['hit_rate']:.3f}" for m in modes]
            lines.append(f"| {name} | {capacity:,} | {_capacity_label(capacity, scenario)} | {' | '.join(cells)} |")
    lines += ["", "Prefill tokens computed (evictions, in each layout's own blocks; \"end\"'s freed window blocks are "
              "not evictions), per mode:", "",
              "| scenario | capacity (blocks) | " + " | ".join(modes) + " |", "|---|---|" + "---|" * len(modes)]
    for name, scenario in report["scenarios"].items():
        for capacity, rows in _by_capacity(scenario).items():
            cells = [f"{rows[m]['computed_tokens']:,} ({rows[m]['evictions']:,})" for m in modes]
            lines.append(f"| {name} | {capacity:,} | {' | '.join(cells)} |")
    lines += ["", "Largest shortfall in exact hit rate against the best mode of the same capacity (capacity, best "
                  "mode there):", "", "| scenario | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for name, scenario in report["scenarios"].items():
        worst = shortfalls(scenario)
        cells = [f"{worst[m]['points']:.3f} ({worst[m]['capacity']:,}: {', '.join(worst[m]['best'])})"
                 if worst[m]["points"] > 0 else "0" for m in modes]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    skipped = sorted({(name, r["capacity"], r["mode"]) for name, s in report["scenarios"].items()
                      for r in s["results"] if r["skipped_requests"]})
    if skipped:
        lines += ["", "Skipped (a prompt larger than the whole pool, refused as the engine would): "
                  + ", ".join(f"{n} @ {c} {m}" for n, c, m in skipped) + "."]
    m = report["machine"]
    shapes = ", ".join(f"{n} ({report['requests'][n]} requests, {s['prompt_tokens']:,} prompt tokens, largest "
                       f"{s['max_prompt_tokens']})" for n, s in report["scenarios"].items())
    lines += ["", f"Scenarios: {shapes}; windows {windows} tokens.",
              f"No model runs: the prompts go through the engine's cache manager only, so these numbers are "
              f"deterministic and the same on any machine. Replayed in {report['replay_seconds']:.1f} s on "
              f"{m['cpu']} ({m['arch']}, {m['cores']} cores), Python {m['python']}."]
    return "\n".join(lines)


def plot(report: dict, path) -> Path:
    """Hit rate (% of prompt tokens) against capacity (log axis), one panel per scenario, one line per retention and
    swa-full dashed. Returns the PNG's path."""
    from kvreuse.bench.plots import Figure, FigureCanvasAgg  # the bench extra

    names = list(report["scenarios"])
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.4 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    styles = {"cold": ("C0", "-", "o"), "policy": ("C1", "-", "s"), "end": ("C2", "-", "^"),
              SWA_FULL: ("0.3", "--", "x")}
    for index, name in enumerate(names):
        ax = axes[index // cols][index % cols]
        table = _by_capacity(report["scenarios"][name])
        capacities = list(table)
        for mode in report["modes"]:
            colour, line, marker = styles[mode]
            ax.plot(capacities, [100 * table[c][mode]["hit_rate"] for c in capacities], color=colour,
                    linestyle=line, marker=marker, markersize=4, label=mode)
        ax.set_xscale("log")
        ticks = sorted({*capacities[::3], capacities[-1]})
        ax.minorticks_off()
        ax.set_xticks(ticks, [f"{c:,}" for c in ticks], rotation=30, fontsize="small")
        ax.set_title(name, fontsize="medium")
        ax.set_xlabel(f"pool blocks ({report['layers_per_block']} layers each)")
        ax.set_ylabel("exact hit rate (%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    for index in range(len(names), rows * cols):
        axes[index // cols][index % cols].set_visible(False)
    axes[0][0].legend(title="window retention", fontsize="small")
    fig.suptitle(f"Which window blocks to keep: {report['model']}\n{report['layout']}\nexact prefix hit rate "
                 f"against pool size (cache replay, no model run)", fontsize="medium")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=110)
    return path
