"""`kvreuse bench windows` (bench/window_retention.py): the window retentions through the cache simulator on Gemma
3-shaped layouts with synthetic prompts; capacities and the swa-full reference's conversion; the tables, the PNG and
the CLI end to end on a tiny random-weight Gemma 3 (and, marked slow, on the real 270M model's tokenizer)."""

from __future__ import annotations

import json
import random

import pytest

from kvreuse.bench import window_retention as wr
from kvreuse.cli import main
from kvreuse.config import CacheConfig
from kvreuse.kvcache.layout import KVLayout
from kvreuse.layers.rotary import Rope
from kvreuse.model.args import ModelArgs

WINDOW, BLOCK = 64, 16
CACHE = CacheConfig(block_size=BLOCK)


def gemma_args(num_layers: int, pattern: int = 6, window: int = WINDOW) -> ModelArgs:
    """Gemma 3's layer plan (every `pattern`-th layer full): 18 layers give 270M's 6 groups of 3."""
    kinds = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))
    return ModelArgs(architecture="gemma3", vocab_size=10, hidden_size=64, intermediate_size=128,
                     num_layers=num_layers, num_heads=4, num_kv_heads=1, head_dim=16, rope=Rope(10000.0),
                     rms_norm_eps=1e-6, max_position_embeddings=32768, layer_kinds=kinds, sliding_window=window)


ARGS = gemma_args(18)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 40000) for _ in range(n)]


def rag_like(num_questions: int = 6) -> list[list[int]]:
    """One shared document (6 blocks), each time followed by its own question, longer than the window: every
    request's window has passed the document's end before the request ends."""
    document = tokens(6 * BLOCK, 0)
    return [document + tokens(WINDOW + 40, 100 + i) for i in range(num_questions)]


def within_window_and_chats() -> list[list[int]]:
    """Prompts that never need a window an earlier prompt passed: short ones (inside the window) sharing a system
    prompt, and chats whose every turn extends the last."""
    system = tokens(2 * BLOCK, 1)
    short = [system + tokens(20, 10 + i) for i in range(4)]
    chats = []
    for c in range(2):
        turn = tokens(100, 20 + c)
        for t in range(4):
            chats.append(list(turn))
            turn += tokens(40, 30 + 10 * c + t)
    return short + chats


def results(report: dict, scenario: str) -> dict[tuple[int, str], dict]:
    return {(r["capacity"], r["mode"]): r for r in report["scenarios"][scenario]["results"]}


def test_with_no_pressure_the_retentions_agree_where_no_prompt_needs_a_passed_window():
    prompts = {"mixed": within_window_and_chats()}
    report = wr.run(ARGS, prompts, "fp", cache=CACHE, capacities=[10_000])
    by = results(report, "mixed")
    assert by[10_000, "cold"]["evictions"] == 0
    counts = lambda mode: {k: v for k, v in by[10_000, mode].items() if k != "mode"}
    assert counts("cold")["cached_tokens"] > 0
    assert counts("policy") == counts("cold") == counts("end")
    assert by[10_000, wr.SWA_FULL]["cached_tokens"] == counts("cold")["cached_tokens"]


def test_with_no_pressure_cold_and_policy_agree_and_end_loses_the_passed_document_windows():
    report = wr.run(ARGS, {"rag": rag_like()}, "fp", cache=CACHE, capacities=[10_000])
    by = results(report, "rag")
    assert {**by[10_000, "cold"], "mode": "policy"} == by[10_000, "policy"]
    assert by[10_000, "cold"]["cached_tokens"] == 5 * 6 * BLOCK == by[10_000, wr.SWA_FULL]["cached_tokens"]
    assert by[10_000, "end"]["cached_tokens"] == 0  # the windows before the document's end were freed at once


def test_under_pressure_on_a_rag_workload_end_hits_less_than_cold():
    """The document's questions interleaved with unrelated prompts, in a pool of twice the largest prompt."""
    prompts = [p for i, question in enumerate(rag_like()) for p in (question, tokens(3 * BLOCK, 200 + i))]
    largest = wr.admission_blocks(KVLayout.of(ARGS), max(map(len, prompts)), BLOCK)
    report = wr.run(ARGS, {"rag": prompts}, "fp", cache=CACHE, capacities=[2 * largest])
    by = results(report, "rag")
    cold, end = by[2 * largest, "cold"], by[2 * largest, "end"]
    assert cold["evictions"] > 0 and cold["skipped_requests"] == 0
    assert end["cached_tokens"] < cold["cached_tokens"]
    assert end["computed_tokens"] > cold["computed_tokens"]
    assert cold["computed_tokens"] + cold["cached_tokens"] == cold["prompt_tokens"] == sum(map(len, prompts))


def test_swa_full_gets_the_same_memory_in_blocks_of_every_layer():
    layout, full = KVLayout.of(ARGS), KVLayout.of(ARGS, keep_window_kv=True)
    assert (layout.layers_per_block, full.layers_per_block) == (3, 18)
    assert wr.full_capacity(600, layout, full) == 100
    one_b = gemma_args(26)  # Gemma 3 1B: 7 groups of 4 layers (the last holds 2), so not capacity // 7
    assert wr.full_capacity(700, KVLayout.of(one_b), KVLayout.of(one_b, keep_window_kv=True)) == 700 * 4 // 26
    report = wr.run(ARGS, {"rag": rag_like(2)}, "fp", cache=CACHE, capacities=[600, 601])
    by = results(report, "rag")
    assert [by[c, wr.SWA_FULL]["pool_blocks"] for c in (600, 601)] == [100, 100]
    assert by[600, "cold"]["pool_blocks"] == 600


def test_default_capacities_span_one_largest_prompt_to_no_pressure():
    layout, prompts = KVLayout.of(ARGS), rag_like() + within_window_and_chats()
    capacities, no_pressure = wr.default_capacities(prompts, layout, BLOCK)
    largest = wr.admission_blocks(layout, max(map(len, prompts)), BLOCK)
    assert capacities[0] == largest and capacities[-1] == no_pressure
    assert no_pressure == sum(wr.admission_blocks(layout, len(p), BLOCK) for p in prompts)
    assert capacities == sorted(set(capacities)) and all(c % len(layout.groups) == 0 for c in capacities[:-1])
    report = wr.run(ARGS, {"all": prompts}, "fp", cache=CACHE)
    assert report["scenarios"]["all"]["capacities"] == capacities
    by = results(report, "all")
    assert all(by[no_pressure, m]["evictions"] == 0 for m in wr.MODES)
    assert by[largest, "cold"]["evictions"] > 0
    assert wr.num_replays({"all": prompts}, None, wr.DEFAULT_MULTIPLES, ARGS, BLOCK) == len(report["scenarios"]["all"]
                                                                                             ["results"])


def test_a_model_without_window_groups_is_refused():
    with pytest.raises(ValueError, match="no grouped layout"):
        wr.run(gemma_args(6, pattern=1), {"rag": rag_like(1)}, "fp", cache=CACHE, capacities=[100])


def test_the_tables_mark_the_best_mode_and_the_plot_is_a_png(tmp_path):
    report = wr.run(ARGS, {"rag": rag_like(), "mixed": within_window_and_chats()}, "fp", cache=CACHE,
                    capacities=[200, 10_000])
    table = wr.markdown(report)
    assert "| scenario | capacity (blocks) | vs largest prompt | cold | policy | end | swa-full |" in table
    assert "| rag | 10,000 | " in table and "**" in table and "deterministic" in table
    assert report["scenarios"]["rag"]["shortfalls"]["end"]["points"] == results(report, "rag")[10_000, "cold"][
        "hit_rate"]
    path = wr.plot(report, tmp_path / wr.PNG)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_windows_prints_the_table_and_writes_the_report(grouped_gemma_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "windows", "--model", grouped_gemma_dir, "--quick", "--scenarios", "chat", "rag",
                 "--block-size", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| chat | " in printed and "| rag | " in printed and "no pressure" in printed
    report = json.loads((out / "window-retention.json").read_text())
    assert report["groups"] == 3 and report["layers_per_block"] == 2 and report["windows"] == [20]
    assert report["requests"] == {"chat": 8, "rag": 8}
    assert len(report["scenarios"]["rag"]["capacities"]) == 3  # --quick: 1x, 4x and no pressure
    assert (out / "window-retention.md").read_text().strip() == printed.strip()
    assert (out / wr.PNG).is_file()


def test_bench_windows_refuses_a_model_without_sliding_windows(tiny_model_dir, capsys):
    assert main(["bench", "windows", "--model", tiny_model_dir, "--quick"]) == 2
    assert "no grouped KV layout" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_windows_on_gemma3_270m(tmp_path, capsys):
    """The default model and its default template (examples/gemma3-chat.jinja): 6 groups of 3 layers."""
    assert main(["bench", "windows", "--quick", "--scenarios", "chat", "prefix", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "window-retention.json").read_text())
    assert report["model"] == "gemma3-270m" and report["groups"] == 6 and report["windows"] == [512]
    rows = {(r["capacity"], r["mode"]): r for r in report["scenarios"]["prefix"]["results"]}
    assert all(r["hit_rate"] > 0.5 for r in rows.values())  # groups sharing a long system prompt
