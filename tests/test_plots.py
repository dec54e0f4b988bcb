"""Bench plots: the PNGs are valid images, and the block-size sweep's hit rates behave as the cache's rules say."""

from __future__ import annotations

import pytest
from matplotlib.image import imread

from kvreuse.analyze import analyze
from kvreuse.bench import workloads
from kvreuse.bench.plots import block_size_sweep, hit_rate_plot, ttft_plot, write_plots
from kvreuse.config import Config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BLOCK_SIZES = [8, 16, 32, 64]


def scenario_report() -> dict:
    """A scenario report by hand; "hf" ran only in chat, as a peer mode may."""
    result = lambda mean, p99: {"mean_ttft_ms": mean, "median_ttft_ms": mean, "p99_ttft_ms": p99,
                                "exact_hit_rate": 0.5, "approximate_hit_rate": 0.1}
    return {"suite": "scenario", "requests": 4, "max_tokens": 4, "block_size": 16, "scenarios": {
        "chat": {"no-cache": result(120.0, 150.0), "prefix": result(40.0, 90.0), "hf": result(200.0, 260.0)},
        "rag": {"no-cache": result(300.0, 310.0), "prefix": result(250.0, 300.0), "blend": result(90.0, 140.0)},
    }}


def assert_png(path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300 and image.shape[2] in (3, 4)
    assert image.std() > 0  # something was drawn


def test_ttft_plot_writes_a_png(tmp_path):
    path = ttft_plot(scenario_report(), tmp_path / "sub" / "ttft.png")
    assert path == tmp_path / "sub" / "ttft.png"
    assert_png(path)


@pytest.fixture(scope="module")
def sweep() -> dict:
    return block_size_sweep(["chat", "rag"], BLOCK_SIZES, num_requests=6)


def test_sweep_hit_rates_fall_as_blocks_grow(sweep):
    assert sweep["block_sizes"] == BLOCK_SIZES and set(sweep["scenarios"]) == {"chat", "rag"}
    for name, rates in sweep["scenarios"].items():
        assert all(len(values) == len(BLOCK_SIZES) for values in rates.values())
        assert all(0.0 <= v <= 1.0 for values in rates.values() for v in values), name
        # Segment reuse adds to the exact hits and never takes more than the whole share.
        assert all(seg <= whole for seg, whole in zip(rates["segment"], rates["with_segments"], strict=True)), name
        # A prompt whose first k blocks of 2b tokens hit was preceded by one sharing those 2bk tokens, which
        # left 2k blocks of b tokens cached, and the cap of (L - 1) // b blocks allows them: no fewer hits.
        # (The sizes double, so each grid refines the next; no eviction with so few prompts.)
        assert rates["exact"] == sorted(rates["exact"], reverse=True), name
    assert sweep["scenarios"]["chat"]["exact"][BLOCK_SIZES.index(16)] > 0


def test_sweep_at_the_configured_block_size_matches_analyze(sweep):
    # The sweep holds the pool's capacity in tokens at the configured block size's, so there it is analyze's replay.
    predicted = analyze(workloads.chat(6), Config())
    assert sweep["scenarios"]["chat"]["exact"][BLOCK_SIZES.index(16)] == pytest.approx(predicted["hit_rate"], abs=1e-4)


def test_unknown_scenario_is_refused():
    with pytest.raises(ValueError, match="unknown scenario"):
        block_size_sweep(["nope"], [16], 2)


def test_write_plots_writes_both_files(tmp_path, sweep):
    paths = write_plots(scenario_report(), sweep, tmp_path)
    assert [p.name for p in paths] == ["scenario_ttft.png", "hit_rate_vs_block_size.png"]
    for path in paths:
        assert_png(path)
    assert write_plots(scenario_report(), None, tmp_path / "no-sweep") == [tmp_path / "no-sweep" / "scenario_ttft.png"]


def test_hit_rate_plot_accepts_a_sweep_without_the_sum(tmp_path):
    sweep = {"block_sizes": [16, 32], "scenarios": {"eval": {"exact": [0.1, 0.0], "segment": [0.7, 0.6]}}}
    assert_png(hit_rate_plot(sweep, tmp_path / "h.png"))
