"""The shape the code keeps: no import runs up a floor of docs/design/architecture.md's Layers and no circle runs
between the top-level rooms (but the known ones, listed), the KV cache (tiers included) stands alone, every function
in the package stays small, and the reuse counters are named in one place (ReuseRecord) and rendered everywhere from
it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvreuse.bench.metrics import reuse_metrics
from kvreuse.engine.output import RequestOutput, Usage
from kvreuse.kvcache.accounting import ReuseRecord
from kvreuse.server.metrics import Metrics
from kvreuse.server.usage import usage

from .server_process import Metrics as Scrape

PACKAGE = Path(__file__).resolve().parent.parent / "kvreuse"
MAX_FUNCTION_LINES = 60


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    return modules


def relative(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


# Every module of the KV cache, its subpackages (tiers/) too.
@pytest.mark.parametrize("path", sorted((PACKAGE / "kvcache").rglob("*.py")), ids=relative)
def test_the_kv_cache_imports_nothing_from_the_layers_above_it(path):
    above = ("kvreuse.engine", "kvreuse.server", "kvreuse.bench", "kvreuse.cli", "kvreuse.llm", "kvreuse.analyze")
    assert not {m for m in imported_modules(path) if m.startswith(above)}


def test_the_layering_test_sees_the_tiers():
    assert "kvreuse/kvcache/tiers/store.py" in {relative(p) for p in (PACKAGE / "kvcache").rglob("*.py")}


# --- the floors: the ground floor imports nothing above it, and no circle runs between the top-level rooms ---------
def room(path: Path) -> str | None:
    """The top-level package or module of kvreuse that the file at `path` belongs to (`model`, `config`, `llm`);
    None for the package's own `__init__.py` and `__main__.py`."""
    first = path.relative_to(PACKAGE).parts[0]
    return None if first in ("__init__.py", "__main__.py") else first.removesuffix(".py")


def imported_rooms(path: Path) -> set[str]:
    """The rooms of kvreuse that the file at `path` imports from, anywhere in it (inside functions and
    TYPE_CHECKING blocks too), its own room left out."""
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from kvreuse import extras` imports the room `extras`
            names = [f"{node.module}.{alias.name}" if node.module == "kvreuse" else node.module for alias in node.names]
        else:
            continue
        rooms.update(name.split(".")[1] for name in names if name.startswith("kvreuse."))
    return rooms - {room(path)}


def room_graph() -> dict[str, set[str]]:
    """Each room -> the rooms it imports from."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if (name := room(path)) is not None:
            graph.setdefault(name, set()).update(imported_rooms(path))
    return graph


# The ground floor and what each of its rooms may import of kvreuse's besides itself: config/ is read by every layer
# (the model included), and cache_dir and extras by config/, the model, the kernels and the tiers; embedded/ holds the
# default model's file, which its build backend reads without importing kvreuse.
GROUND_FLOOR = {"cache_dir": set(), "extras": set(), "embedded": set(), "config": {"extras"}}


@pytest.mark.parametrize("name", sorted(GROUND_FLOOR))
def test_the_ground_floor_imports_nothing_above_it(name):
    files = sorted((PACKAGE / name).rglob("*.py")) if (PACKAGE / name).is_dir() else [PACKAGE / f"{name}.py"]
    above = {relative(path): imported_rooms(path) - GROUND_FLOOR[name] for path in files}
    assert not {where: rooms for where, rooms in above.items() if rooms}


def floors() -> list[set[str]]:
    """The Layers diagram of docs/design/architecture.md, top floor first: each floor's rooms (`model/` -> `model`,
    `llm.py` -> `llm`). A floor's names come first on its line, before a run of spaces and its description; a line
    that starts with spaces continues the description above."""
    text = (PACKAGE.parent / "docs" / "design" / "architecture.md").read_text(encoding="utf-8")
    diagram = text.split("\n## Layers\n", 1)[1].split("```\n", 2)[1]
    names = [re.split(r"\s{2,}", line, maxsplit=1)[0] for line in diagram.splitlines() if line and line[0] != " "]
    return [{name.strip().removesuffix("/").removesuffix(".py") for name in line.split(",")} for line in names]


def test_the_layers_diagram_puts_every_room_on_one_floor():
    placed = [name for floor in floors() for name in floor]
    assert len(placed) == len(set(placed)), "a room is on two floors"
    assert set(placed) == set(room_graph()), "the diagram's rooms are not the package's top-level packages and modules"


def test_no_import_runs_up_a_floor():
    level = {name: depth for depth, floor in enumerate(floors()) for name in floor}
    up = sorted(f"{source} -> {target}" for source, targets in room_graph().items() for target in targets
                if level[target] < level[source])
    assert not up, "imports up a floor of docs/design/architecture.md's Layers:\n  " + "\n  ".join(up)


def find_circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of `graph` as the rooms along it, first repeated at the end; [] if there is none."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        for successor in sorted(graph.get(node, ())):
            if circle := visit(successor, [*path, node]):
                return circle
        done.add(node)
        return []

    return next((circle for node in sorted(graph) if (circle := visit(node, []))), [])


def test_no_import_circle_runs_between_the_top_level_rooms():
    circle = find_circle(room_graph())
    assert not circle, "an import circle between kvreuse's rooms: " + " -> ".join(circle)


def test_the_circle_test_finds_a_circle():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}}) == []
    graph = room_graph()
    graph["layers"].add("server")  # the layers reaching up to the server would close a circle
    assert find_circle(graph)


def long_functions(path: Path) -> list[str]:
    """`path:line name (N lines)` for each function (nested ones and methods too) over MAX_FUNCTION_LINES."""
    long = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                long.append(f"{relative(path)}:{node.lineno} {node.name} ({length} lines)")
    return long


# One test per top-level package (engine, server, bench, cli, kvcache, ...) and one for the top-level modules, so
# a failure names the package; every .py below kvreuse/ is in exactly one of them.
PACKAGES = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
TOP_LEVEL = "(top level)"


def package_files(package: str) -> list[Path]:
    if package == TOP_LEVEL:
        return sorted(PACKAGE.glob("*.py"))
    return sorted((PACKAGE / package).rglob("*.py"))


@pytest.mark.parametrize("package", [*PACKAGES, TOP_LEVEL])
def test_functions_stay_small(package):
    long = [entry for path in package_files(package) for entry in long_functions(path)]
    where = "kvreuse/*.py" if package == TOP_LEVEL else f"kvreuse/{package}/"
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines in {where}, split them:\n  " + "\n  ".join(long)


def test_the_function_size_test_covers_every_module():
    covered = {p for package in [*PACKAGES, TOP_LEVEL] for p in package_files(package)}
    assert covered == set(PACKAGE.rglob("*.py"))
    assert {"engine", "server", "bench", "kvcache", "model"} <= set(PACKAGES)


def manager_calls(path: Path, *receivers: str) -> set[str]:
    """The methods called on `receivers` (names, or `self.<attribute>`) in the module at `path`."""
    called = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = ast.unparse(node.func.value)
            if receiver in receivers:
                called.add(node.func.attr)
    return called


ADMISSION = {"match", "can_admit", "admit"}  # the manager's admission pair (vLLM: get_computed_blocks, allocate_slots)


def test_the_simulator_admits_and_updates_through_the_schedulers_own_calls():
    """Neither copies admission or the postprocess by hand: both call the manager's admission pair, and its `update`
    after a forward (the scheduler's `update`), and the simulator calls nothing else of the manager's but making and
    freeing a request."""
    simulator = manager_calls(PACKAGE / "kvcache" / "simulate.py", "manager")
    scheduler = manager_calls(PACKAGE / "engine" / "scheduler.py", "kv", "self.kv_manager")
    assert ADMISSION | {"update"} <= scheduler
    assert simulator == ADMISSION | {"new_request", "update", "free"}


def test_records_add_up_field_by_field_and_keep_their_invariants():
    a = ReuseRecord.planned(100, num_cached_tokens=32, num_reused_tokens=48, num_shifted_tokens=16)
    b = ReuseRecord(prompt_tokens=10, computed_prompt_tokens=10, guarded_requests=1)
    total = a + b
    assert total.prompt_tokens == 110 and total.computed_prompt_tokens == 30 and total.guarded_requests == 1
    assert total.hit_rate == pytest.approx(32 / 110)
    with pytest.raises(AssertionError):
        ReuseRecord(prompt_tokens=10, cached_tokens=4)              # 4 + 0 + 0 != 10


TIER_SPLIT = {"cached_tokens_disk", "cached_tokens_redis"}  # one labeled counter, kvreuse:tier_hit_tokens{tier}


def test_every_counter_has_its_own_prometheus_name():
    names = [metric for _, metric, _ in ReuseRecord.metrics()]
    assert len(set(names)) == len(names) == len(ReuseRecord.field_names()) - len(TIER_SPLIT)
    assert {name for name, _, _ in ReuseRecord.metrics()} == set(ReuseRecord.field_names()) - TIER_SPLIT


def test_the_bench_rows_carry_every_field_of_the_record():
    row = reuse_metrics(ReuseRecord.planned(50, 16, 16))
    assert set(ReuseRecord.field_names()) <= set(row)
    assert row["prefill_tokens_computed"] == 18 and row["exact_hit_rate"] == pytest.approx(16 / 50)


def finished_output() -> RequestOutput:
    record = ReuseRecord(prompt_tokens=100, cached_tokens=32, reused_tokens=48, shifted_tokens=16,
                         recomputed_tokens=12, discarded_tokens=3, computed_prompt_tokens=20, guarded_requests=1,
                         cached_tokens_disk=16, cached_tokens_redis=8)
    return RequestOutput("r", "text", [1, 2], "stop", Usage(**record.as_dict(), completion_tokens=2), 0.1, 0.2, 0)


def test_the_usage_json_carries_exactly_the_record_fields():
    body = usage(finished_output())
    assert body["prompt_tokens"] == 100 and body["completion_tokens"] == 2 and body["total_tokens"] == 102
    details = body["prompt_tokens_details"]
    assert set(details) == set(ReuseRecord.field_names()) - {"prompt_tokens"} - TIER_SPLIT | {"cached_tokens_details"}
    assert (details["cached_tokens"], details["shifted_tokens"], details["guarded_requests"]) == (32, 16, 1)
    assert details["cached_tokens_details"] == {"memory": 8, "disk": 16, "redis": 8}


def test_prometheus_counts_every_field_of_the_record_under_its_own_name():
    metrics = Metrics("m")
    out = finished_output()
    metrics.observe_finished(out)
    metrics.observe_finished(out)
    scrape = Scrape.parse(metrics.exposition().decode())
    for name, metric, _ in ReuseRecord.metrics():
        assert scrape.get(f"{metric}_total", model_name="m") == 2 * getattr(out.usage, name), metric
    for tier, num_tokens in out.usage.cached_by_tier().items():
        assert scrape.get("kvreuse:tier_hit_tokens_total", model_name="m", tier=tier) == 2 * num_tokens, tier


# --- the module map in docs/design/architecture.md -------------------------------------------------------------
def _module_map() -> dict[str, str]:
    """The `## Modules` table of docs/design/architecture.md: its first column (a module or a folder) -> its row."""
    text = (PACKAGE.parent / "docs" / "design" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Modules\n", 1)[1].split("\n## ", 1)[0]
    return {line.split("`")[1]: line for line in section.splitlines() if line.startswith("| `")}


def test_the_module_map_names_every_module():
    """Each module of the package has a row of its own, or is named in its folder's row (`kvcache/eviction/`:
    `lru.py`; `cli/`: `generate`)."""
    rows = _module_map()
    unnamed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if path.name in ("__init__.py", "__main__.py") or module in rows:
            continue
        folders = [name for name in rows if name.endswith("/") and module.startswith(name)]
        if not any(path.name in rows[folder] or f"`{path.stem}`" in rows[folder] for folder in folders):
            unnamed.append(module)
    assert not unnamed, f"docs/design/architecture.md's module map lacks {unnamed}"


def test_the_module_map_names_no_module_that_is_gone():
    gone = [name for name in _module_map() if name.endswith(".py") and not (PACKAGE / name).exists()]
    assert not gone, f"docs/design/architecture.md's module map names modules that do not exist: {gone}"
