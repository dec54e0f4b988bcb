"""`model.dtype = auto` on a CPU: the probe's answer decides, is logged, is cached on disk per machine and model
shapes, and explicit dtypes never run it. The timing itself is replaced: tests measure nothing."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kvreuse.engine.engine import LLMEngine, resolve_dtype
from kvreuse.layers.rotary import Rope
from kvreuse.model.args import ModelArgs
from kvreuse.tuning import dtype_probe

from .conftest import TINY
from .helpers import tiny_engine

CPU = torch.device("cpu")
ARGS = ModelArgs(vocab_size=100, hidden_size=TINY["hidden_size"], intermediate_size=TINY["intermediate_size"],
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope=Rope(1e4), rms_norm_eps=1e-5,
                 max_position_embeddings=4096)


@pytest.fixture
def _auto_dtype_is_fp32():
    """Overrides conftest's pin: these tests run the probe (with its timing replaced)."""


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path))
    return tmp_path / "dtype_probe"


def figures(fp32_prefill: float, bf16_prefill: float, fp32_decode: float = 1.0, bf16_decode: float = 1.0):
    return dtype_probe.Figures(512, fp32_prefill, bf16_prefill, fp32_decode, bf16_decode, probe_s=0.25)


@pytest.fixture
def measured(monkeypatch):
    """Replaces the timing: set `.next` to the Figures the next measurement returns; `.calls` counts them."""

    class Fake:
        next = figures(3.0, 1.0)
        calls = 0

        def __call__(self, shapes, tokens):
            self.calls += 1
            return self.next

    fake = Fake()
    monkeypatch.setattr(dtype_probe, "measure", fake)
    return fake


@pytest.mark.parametrize(("measurement", "expected"), [
    (figures(3.0, 1.0), torch.bfloat16),                   # bf16 3x faster on prefill GEMMs
    (figures(1.0, 7.0), torch.float32),                    # an AVX2 CPU: bf16 7x slower
    (figures(3.0, 1.0, 1.0, 1.5), torch.bfloat16),         # prefill decides, though bf16 loses the GEMVs
    (figures(1.1, 1.0), torch.float32),                    # under the margin: the more exact fp32
])
def test_auto_takes_the_dtype_the_probe_measured_faster_and_logs_it(measured, caplog, measurement, expected):
    measured.next = measurement
    with caplog.at_level(logging.INFO, logger="kvreuse.engine.resolved_model"):
        dtype, why = resolve_dtype("auto", CPU, ARGS)
    assert dtype == expected
    assert why == f"auto: bf16 {measurement.fp32_prefill_s / measurement.bf16_prefill_s:.1f}x fp32 on prefill GEMMs"
    [record] = [r for r in caplog.records if "model.dtype = auto" in r.getMessage()]
    name = "bf16" if expected == torch.bfloat16 else "fp32"
    message = record.getMessage()
    assert message.startswith(f"model.dtype = auto: {name} on this CPU; prefill GEMMs (512 tokens): fp32 ")
    assert f"fp32 {measurement.fp32_prefill_s * 1e3:.2f} ms" in message
    assert f"bf16 {measurement.bf16_prefill_s * 1e3:.2f} ms" in message
    assert "batch-1 GEMVs" in message and "measured in 250 ms" in message
    assert f"; {name}, because bf16 is taken only where it runs the prefill GEMMs at least 1.2x as fast" in message


@pytest.mark.parametrize(("measurement", "pace"), [
    (figures(3.0, 1.0, 1.0, 25.0), "bf16 took 25.0x as long"),   # the "bf16 0.04x", in words
    (figures(3.0, 1.0, 2.0, 1.0), "bf16 ran 2.00x as fast"),
])
def test_the_log_says_what_the_gemv_ratio_means_and_that_it_does_not_decide(measured, measurement, pace):
    measured.next = measurement
    message = dtype_probe.probe(ARGS).describe()
    f = measurement
    assert f"batch-1 GEMVs (a decode step's shape): fp32 {f.fp32_decode_s * 1e6:.0f} us, " \
           f"bf16 {f.bf16_decode_s * 1e6:.0f} us: {pace}" in message
    assert "here it ran 3.00x as fast; the GEMV figure does not count" in message


@pytest.mark.parametrize(("name", "device", "expected"), [
    ("fp32", "cpu", torch.float32), ("bf16", "cpu", torch.bfloat16),
    ("fp32", "cuda", torch.float32), ("auto", "cuda", torch.bfloat16),
])
def test_explicit_dtypes_and_cuda_never_run_the_probe(measured, name, device, expected):
    dtype, why = resolve_dtype(name, torch.device(device), ARGS)
    assert dtype == expected and measured.calls == 0
    assert why == ("auto: cuda" if name == "auto" else "")


def test_the_answer_is_measured_once_then_read_from_disk(measured, cache_dir):
    first = dtype_probe.probe(ARGS)
    second = dtype_probe.probe(ARGS)
    assert measured.calls == 1
    assert (first.from_cache, second.from_cache) == (False, True)
    assert second.figures == first.figures and second.dtype == torch.bfloat16
    assert [p.name for p in cache_dir.iterdir()] == [first.cache_path.name]  # no temporary file left behind
    assert "cached in" in second.describe()


@pytest.mark.parametrize("damage", ["{not json", "", '{"key": 1}', "[]", '{"key": null, "value": {}}'])
def test_a_corrupted_cache_file_is_ignored_and_rewritten(measured, damage):
    path = dtype_probe.probe(ARGS).cache_path
    path.write_text(damage)
    again = dtype_probe.probe(ARGS)
    assert measured.calls == 2 and not again.from_cache
    assert json.loads(path.read_text())["value"]["fp32_prefill_s"] == 3.0
    assert dtype_probe.probe(ARGS).from_cache and measured.calls == 2


def test_nonsense_figures_in_the_cache_are_measured_again(measured):
    path = dtype_probe.probe(ARGS).cache_path
    stored = json.loads(path.read_text())
    stored["value"]["bf16_prefill_s"] = 0
    path.write_text(json.dumps(stored))
    assert not dtype_probe.probe(ARGS).from_cache and measured.calls == 2


@pytest.mark.parametrize("change", ["threads", "torch", "shapes", "cpu"])
def test_the_cache_key_changes_with_what_decides_the_answer(measured, monkeypatch, change):
    before = dtype_probe.probe(ARGS).cache_path
    args = ARGS
    if change == "threads":
        threads = torch.get_num_threads() + 1
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.1")
    elif change == "shapes":
        args = ModelArgs(**{**ARGS.__dict__, "intermediate_size": 2 * ARGS.intermediate_size})
    else:
        identity = dtype_probe.cpu_identity()
        monkeypatch.setattr(dtype_probe, "cpu_identity", lambda: {**identity, "flags": ["avx2"]})
    after = dtype_probe.probe(args)
    assert after.cache_path != before and not after.from_cache and measured.calls == 2


def test_an_unwritable_cache_still_answers(measured, cache_dir):
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    cache_dir.write_text("a file where the folder should be")
    result = dtype_probe.probe(ARGS)
    assert result.dtype == torch.bfloat16 and result.cache_path is None and not result.from_cache


def test_the_real_measurement_returns_every_figure():
    result = dtype_probe.measure([(8, 16), (16, 8)], tokens=4)  # minute shapes: what it returns, not how fast
    assert result.prefill_tokens == 4
    assert all(v > 0 for v in (result.fp32_prefill_s, result.bf16_prefill_s, result.fp32_decode_s,
                               result.bf16_decode_s, result.probe_s))


def test_large_models_probe_fewer_prefill_tokens():
    small = dtype_probe.layer_shapes(ARGS)
    big = [(4096, 6144), (4096, 4096), (4096, 22016), (11008, 4096)]  # a 7B layer
    assert dtype_probe.prefill_tokens(small) == dtype_probe.PREFILL_TOKENS
    assert dtype_probe.prefill_tokens(big) == dtype_probe.MIN_PREFILL_TOKENS


def test_the_engine_uses_the_choice_and_its_fingerprint_follows_the_dtype(measured, tiny_model_dir):
    def engine(dtype: str) -> LLMEngine:
        return tiny_engine(tiny_model_dir, model__dtype=dtype, engine__num_kv_blocks=8)

    auto, bf16, fp32 = engine("auto"), engine("bf16"), engine("fp32")
    assert auto.dtype == torch.bfloat16 and auto.runner.kv_cache.dtype == torch.bfloat16
    assert auto.dtype_description == "bf16 (auto: bf16 3.0x fp32 on prefill GEMMs)"
    assert (bf16.dtype_description, fp32.dtype_description) == ("bf16", "fp32")
    # The fingerprint is in every cache key: KV computed in one dtype is never served to the other.
    assert auto.front_end.fingerprint == bf16.front_end.fingerprint != fp32.front_end.fingerprint
    assert auto.kv_manager.fingerprint == auto.front_end.fingerprint
