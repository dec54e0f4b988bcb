"""Up to how many rows the GGUF kernel serves (kvreuse/tuning/kernel_rows.py): the rule, the per-machine cache, the
compiled graphs' row grid that follows the linears' branch, and the probe on the embedded model's own linears, whose
limit every GGUF linear then carries. Only the last test times anything, and it asserts no speed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from kvreuse.kernels import build as kernels
from kvreuse.model.decode_graph import BRANCHING_ROW_GRID, row_buckets
from kvreuse.tuning import kernel_rows
from kvreuse.tuning.kernel_rows import MIN_GAIN, RowTimes, choose_limit

needs_kernel = pytest.mark.skipif(not kernels.load().isa, reason=f"no GGUF kernel here: {kernels.load().reason}")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    return tmp_path / "kernel_rows"


@pytest.mark.parametrize(("kernel_s", "dense_s", "limit"), [
    (0.5, 1.0, 32),                  # the kernel twice as fast at 32 rows
    (1.0, MIN_GAIN * 1.01, 32),      # just past the margin
    (1.0, MIN_GAIN * 0.99, 16),      # faster, but within the margin: a tie is noise
    (2.0, 1.0, 16),                  # the dense GEMM's blocking wins at 32 rows
])
def test_the_kernel_takes_17_to_32_rows_only_where_it_was_clearly_faster(kernel_s, dense_s, limit):
    assert choose_limit([RowTimes(32, kernel_s, dense_s)]) == limit


def fake_linears(num_layers: int, per_layer: int = 4) -> list[list[SimpleNamespace]]:
    """What the probe's key reads of a layer's GGUF linears; `measure` is replaced, so no product runs."""
    return [[SimpleNamespace(out_features=64 * (j + 1), in_features=64, bits=4, group=32, isa=2,
                             weight=torch.empty(0), layer=i) for j in range(per_layer)] for i in range(num_layers)]


@pytest.fixture
def measured(monkeypatch):
    """Replaces the timing: `.next` is what the next measurement returns, `.calls` the layers each one was given."""

    class Fake:
        next = (RowTimes(32, 0.5, 1.0),)
        calls: list[list[int]] = []

        def __call__(self, linears):
            self.calls.append(sorted({lin.layer for lin in linears}))
            return self.next

    fake = Fake()
    monkeypatch.setattr(kernel_rows, "measure", fake)
    return fake


def test_the_probe_samples_layers_across_the_model_and_keeps_its_answer_per_machine(measured, cache_dir):
    layers = fake_linears(30)
    first = kernel_rows.probe(layers)
    assert (first.limit, first.from_cache) == (32, False)
    assert measured.calls == [[0, 5, 10, 15, 20, 25]]  # MEASURED_LAYERS, spread evenly
    assert first.summary == "kernel up to 32 rows (kernel/dense 0.50 at 32; measured)"
    measured.next = (RowTimes(32, 2.0, 1.0),)           # would change the answer, if it were measured again
    again = kernel_rows.probe(layers)
    assert (again.limit, again.from_cache, len(measured.calls)) == (32, True, 1)
    [path] = cache_dir.iterdir()                       # one file, no temporary left behind
    assert json.loads(path.read_text())["value"] == {"times": [{"rows": 32, "kernel_s": 0.5, "dense_s": 1.0}]}


@pytest.mark.parametrize("damage", ["{not json", "", "[]", '{"key": 1}', '{"value": {"times": [{"rows": 32}]}}',
                                    "zero"])
def test_a_damaged_answer_is_measured_again(measured, cache_dir, damage):
    layers = fake_linears(4)
    kernel_rows.probe(layers)
    [path] = cache_dir.iterdir()
    if damage == "zero":
        stored = json.loads(path.read_text())
        stored["value"]["times"][0]["dense_s"] = 0
        damage = json.dumps(stored)
    elif damage.startswith('{"value"'):
        damage = json.dumps({"key": json.loads(path.read_text())["key"], **json.loads(damage)})
    path.write_text(damage)
    measured.next = (RowTimes(32, 2.0, 1.0),)
    result = kernel_rows.probe(layers)
    assert (result.limit, result.from_cache, len(measured.calls)) == (16, False, 2)


def test_another_thread_count_or_dtype_measures_again(measured, monkeypatch):
    layers = fake_linears(4)
    kernel_rows.probe(layers)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    kernel_rows.probe(layers)
    for lin in (lin for linears in layers for lin in linears):
        lin.weight = torch.empty(0, dtype=torch.bfloat16)
    kernel_rows.probe(layers)
    assert len(measured.calls) == 3


class Branching(nn.Module):
    def __init__(self, kernel_max_rows: int):
        super().__init__()
        self.kernel_max_rows = kernel_max_rows


@pytest.mark.parametrize(("children", "max_rows", "buckets"), [
    ([], 64, [(1, 16), (17, 64)]),                                       # a dense model
    ([Branching(16)], 64, [(1, 16), (17, 32), (33, 64)]),               # one grid whatever the limit: 16 ...
    ([Branching(32)], 64, [(1, 16), (17, 32), (33, 64)]),               # ... or 32
    ([Branching(32), Branching(64)], 64, [(1, 16), (17, 32), (33, 64)]),
    ([Branching(24)], 64, [(1, 16)]),                                    # a limit inside a range: eager from there
    ([Branching(32)], 32, [(1, 16), (17, 32)]),                          # a smaller batch budget
    ([], 8, [(1, 1)]),                                                   # a budget under the first range
])
def test_the_compiled_graphs_split_where_the_linears_branch(children, max_rows, buckets):
    assert row_buckets(nn.Sequential(*children), max_rows) == buckets
    assert set(kernel_rows.ROW_LIMITS) <= set(BRANCHING_ROW_GRID)  # every limit the probe picks is a split


@pytest.mark.slow
@needs_kernel
def test_the_embedded_models_linears_carry_the_measured_limit_and_its_products_match(cache_dir):
    from kvreuse.config import load_config
    from kvreuse.engine.engine import LLMEngine
    from kvreuse.weights.gguf_weights import SplitGGUFLinear

    # bf16: the dense weight's GEMM runs in bf16, so prefill may take it (an fp32 model reads only the blocks).
    engine = LLMEngine(load_config(None, ["model.dtype=bf16", "engine.compile=off"]))
    linears = [m for m in engine.runner.model.modules() if isinstance(m, SplitGGUFLinear)]
    [limit] = {lin.kernel_max_rows for lin in linears}
    assert limit in kernel_rows.ROW_LIMITS
    assert f"kernel up to {limit} rows (kernel/dense " in engine.weights_description
    [path] = cache_dir.iterdir()
    times = [RowTimes(**t) for t in json.loads(path.read_text())["value"]["times"]]
    assert choose_limit(times) == limit and all(t.kernel_s > 0 and t.dense_s > 0 for t in times)
    # Whatever was chosen, the kernel's product at the top of the range it may take is the dense product, up to the
    # dense weight's bf16 rounding.
    lin = linears[0]
    x = torch.randn(kernel_rows.ROW_LIMITS[-1], lin.in_features, generator=torch.Generator().manual_seed(0))
    expected = lin.dense_product(x.bfloat16()).float()
    torch.testing.assert_close(lin.kernel_product(x.bfloat16()).float(), expected, rtol=0,
                               atol=2e-2 * expected.abs().max().item())
    engine.close()


@pytest.mark.slow
@needs_kernel
def test_an_fp32_model_reads_every_row_from_the_blocks_where_the_kernel_keeps_up_at_prefill(cache_dir):
    from kvreuse.config import load_config
    from kvreuse.engine.engine import LLMEngine
    from kvreuse.weights.gguf_weights import GGUFLinear, SplitGGUFLinear

    engine = LLMEngine(load_config(None, ["model.dtype=fp32", "engine.compile=off"]))
    linears = [m for m in engine.runner.model.modules() if isinstance(m, GGUFLinear)]
    [path] = cache_dir.iterdir()
    times = [RowTimes(**t) for t in json.loads(path.read_text())["value"]["times"]]
    [prefill] = [t for t in times if t.rows == kernel_rows.PREFILL_ROWS]
    every_row = prefill.kernel_s <= kernel_rows.MAX_PREFILL_COST * prefill.dense_s
    assert ("every row through the kernel" in engine.weights_description) == every_row
    # One copy of the weights where every row reads the blocks; the dense copy where prefill takes it.
    assert all(isinstance(m, SplitGGUFLinear) != every_row for m in linears)
    assert all(hasattr(m, "weight") != every_row for m in linears)
    assert all(hasattr(m, "kernel_max_rows") != every_row for m in linears)  # the compiled graphs' branch
    # The kernel's product is the fp32 dense product up to summation order, at a prefill's row count too.
    dense = LLMEngine(load_config(None, ["model.dtype=fp32", "engine.compile=off", "model.weights=dense"]))
    lin, weight = engine.runner.model.layers[0].qkv_proj, dense.runner.model.layers[0].qkv_proj.weight
    x = torch.randn(kernel_rows.PREFILL_ROWS, lin.in_features, generator=torch.Generator().manual_seed(0))
    expected = torch.nn.functional.linear(x, weight)
    torch.testing.assert_close(lin.kernel_product(x), expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    dense.close()
    engine.close()


@pytest.mark.parametrize(("kernel_s", "dense_s", "every_row"), [
    (0.9, 1.0, True),                                   # faster at prefill: every row
    (kernel_rows.MAX_PREFILL_COST * 0.99, 1.0, True),   # within the price of invariance
    (kernel_rows.MAX_PREFILL_COST * 1.01, 1.0, False),  # past it: the dense GEMM takes prefill
])
def test_every_row_takes_the_kernel_only_where_it_keeps_up_at_prefill(kernel_s, dense_s, every_row):
    times = [RowTimes(32, 0.5, 1.0), RowTimes(64, 0.5, 1.0), RowTimes(kernel_rows.PREFILL_ROWS, kernel_s, dense_s)]
    assert kernel_rows.choose_every_row(times) is every_row
    assert kernel_rows.choose_limit(times) == 64  # the prefill row count is not a limit
