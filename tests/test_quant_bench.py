"""`kvreuse bench quant` on the tiny model: the report's structure, the engines' fingerprints, and how close each
quantized mode stays to the unquantized engine; nothing timed."""

from __future__ import annotations

from kvreuse.bench import quant_bench

from .helpers import tiny_config

# What a working quantization keeps, on the tiny model's 4 fidelity prompts (1 per workload) and 4-token greedy
# continuations. int8 measures top-1 agreement 1.0, mean KL 0.0003 and a mean match of 3.5 tokens here (on the
# embedded model, docs/bench/quant.md: 1.000, 0.0046). Broken on purpose, it measured: outputs 10% too large
# 0.5 / 0.076 / 0.75, weights rounded to 4 bits per channel 0.25 / 0.084 / 0.25, outputs zeroed or scaled 2x or
# shifted a channel 0 / 0.5-1.7 / 0. One first token of the four has its top two logits 0.098 apart and int8 moves
# logits by up to 0.094, so a flip there (0.75) is allowed; the KL bound is what a broken int8 cannot pass.
INT8_MIN_TOP1, INT8_MAX_KL, INT8_MIN_MATCH = 0.75, 0.01, 2.0
# int4 (random weights suffer from it more than trained ones): 0.75 / 0.034 / 0.75 here, 1.000 / 0.0026 on the
# embedded model; bounded against gross breakage only.
INT4_MAX_KL = 0.1


def test_each_quantized_engine_keys_its_cache_apart(tiny_model_dir):
    config = tiny_config(tiny_model_dir, engine__num_kv_blocks=64)
    plain, int8 = quant_bench.quantized_llm(config, "none"), quant_bench.quantized_llm(config, "int8")
    int8_front, plain_front = int8.engine.front_end, plain.engine.front_end
    assert int8_front.fingerprint == f"{plain_front.fingerprint}:w8" == int8.engine.kv_manager.fingerprint
    assert plain.engine.kv_manager.fingerprint == plain_front.fingerprint
    request = int8_front.make_sequence([1, 2, 3])
    assert request.kv.extra_key != plain_front.make_sequence([1, 2, 3]).kv.extra_key


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
    int8, int4 = report["modes"]["int8"], report["modes"]["int4"]
    assert int8["top1_agreement"] >= INT8_MIN_TOP1 and int8["mean_kl"] < INT8_MAX_KL, int8
    assert int8["mean_match_len"] >= INT8_MIN_MATCH, int8
    assert int4["mean_kl"] < INT4_MAX_KL, int4
    # The bytes a decode step streams: int8 codes and a bf16 scale per row are ~1/4 of fp32, int4 less again.
    linears = {mode: row["weight_bytes"]["decoder_linears"] for mode, row in report["modes"].items()}
    assert linears["int4"] < linears["int8"] < 0.3 * linears["none"], linears
    assert int8["tag"] == "w8" and int4["tag"] == "w4g32"
    assert set(report["ratios"]) == {f"{m} {mode}/none" for mode in ("int8", "int4") for m in speed}
    assert all(ratio > 0 for ratio in report["ratios"].values()), report["ratios"]
    assert len(report["samples"]["int4/decode_b1_tok_s"]) == 1
    assert {"cpu", "flags", "torch_threads"} <= set(report["machine"])
    table = quant_bench.markdown(report)
    assert "| int4 | w4g32 |" in table and "| none | - |" in table and "decode_b1_tok_s int8/none" in table
    assert any(line.startswith("round 1/1") for line in lines)
