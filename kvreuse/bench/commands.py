"""What the `kvreuse bench` subcommands share beyond the suites: the config a scenario runs under and the
files `--out` writes."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvreuse.config import PRESETS, Config, load_config


def scenario_config(scenario: str, config_file: str | None, overrides: Sequence[str]) -> Config:
    """The config `scenario` runs under: the config file and `overrides` over the scenario's own preset (none for
    a scenario without one). A preset chosen in `overrides` (--preset, --set cache.preset=) replaces the
    scenario's, since the last preset assignment wins; explicit keys win over any preset."""
    preset = scenario if scenario in PRESETS else "none"
    # The modes switch segment reuse per run, so the config only sets what the preset and the user choose.
    return load_config(config_file, [f"cache.preset={preset}", *overrides])


def write_scenario_plots(out: Path, report: dict, scenarios: list[str], num_requests: int,
                         sweep_config: Config) -> None:
    """Adds the block-size sweep (no model run) to a scenario report as "block_size_sweep" and writes the
    PNG plots of both into `out`."""
    from kvreuse.bench import plots

    out.mkdir(parents=True, exist_ok=True)
    report["block_size_sweep"] = plots.block_size_sweep(scenarios, list(plots.DEFAULT_BLOCK_SIZES), num_requests,
                                                        sweep_config)
    for path in plots.write_plots(report, report["block_size_sweep"], out):
        print(f"wrote {path}", file=sys.stderr)


def write_report(out: Path, name: str, report: dict, table: str) -> None:
    """`out`/<name>.json (the report) and `out`/<name>.md (its table)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{name}.md").write_text(table + "\n")
    print(f"wrote {out / name}.json and .md", file=sys.stderr)
