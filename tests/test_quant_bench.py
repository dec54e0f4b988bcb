"""`kvreuse bench quant` on the tiny model: the report's structure and the engines' fingerprints, nothing timed."""

from __future__ import annotations

from kvreuse.bench import quant_bench

from .conftest import make_config


def test_each_quantized_engine_keys_its_cache_apart(tiny_model_dir):
    config = make_config(model__path=tiny_model_dir, model__dtype="fp32", engine__num_kv_blocks=64)
    plain, int8 = quant_bench.quantized_llm(config, "none"), quant_bench.quantized_llm(config, "int8")
    assert int8.engine.fingerprint == f"{plain.engine.fingerprint}:w8" == int8.engine.kv_manager.fingerprint
    assert plain.engine.kv_manager.fingerprint == plain.engine.fingerprint
    request = int8.engine.make_sequence([1, 2, 3])
    assert request.kv.extra_key != plain.engine.make_sequence([1, 2, 3]).kv.extra_key


def test_the_report_has_every_mode_metric_and_fidelity_row(tiny_model_dir):
    lines = []
    report = quant_bench.run(dtype="fp32", repeats=1, progress=lines.append, num_prompts=4, continuation=4,
                             prefill_tokens=32, decode_tokens=4, overrides=[f"model.path={tiny_model_dir}"])
    assert list(report["modes"]) == ["none", "int8", "int4"]
    assert report["fidelity_prompts"] == {"chat": 1, "rag": 1, "agent": 1, "eval": 1}
    speed = {"prefill_32_tok_s", "decode_b1_tok_s", "decode_b8_tok_s"}
    for mode, row in report["modes"].items():
        assert all(row[m] > 0 for m in speed), mode
        assert row["weight_bytes"]["decoder_linears"] > 0
        if mode != "none":
            assert 0 <= row["top1_agreement"] <= 1 and row["mean_kl"] >= 0 and 0 <= row["mean_match_len"] <= 4
            assert set(row["per_workload"]) == {"chat", "rag", "agent", "eval"}
    assert report["modes"]["int8"]["tag"] == "w8" and report["modes"]["int4"]["tag"] == "w4g32"
    assert set(report["ratios"]) == {f"{m} {mode}/none" for mode in ("int8", "int4") for m in speed}
    assert len(report["samples"]["int4/decode_b1_tok_s"]) == 1
    assert {"cpu", "flags", "torch_threads"} <= set(report["machine"])
    table = quant_bench.markdown(report)
    assert "| int4 | w4g32 |" in table and "| none | - |" in table and "decode_b1_tok_s int8/none" in table
    assert any(line.startswith("round 1/1") for line in lines)
