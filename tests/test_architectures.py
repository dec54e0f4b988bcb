"""Every supported architecture against Hugging Face transformers, on tiny random-weight models built by transformers
in the test: last-row logits and greedy tokens, with the prefix cache on and off, chunked prefill, a batch of mixed
lengths, and prompts longer than the sliding window. Every parameter is randomized (random_models.randomize_:
transformers initializes biases at 0, q/k norms at 1 and Gemma's norms at 0, which would hide exactly the features
under test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvreuse.bench.random_models import randomize_
from kvreuse.layers.attention import AttentionMetadata
from kvreuse.model.architectures import ARCHITECTURES
from kvreuse.model.decoder import ForwardKV
from kvreuse.weights.errors import ModelLoadError
from kvreuse.weights.loader import load_model_info, load_weights

from .helpers import greedy, tiny_llm

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 24  # shorter than the long prompts, and not a multiple of the block size
# name: (transformers config class, its settings beyond SHAPE)
MODELS = {
    "llama3": ("LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-linear": ("LlamaConfig", dict(num_hidden_layers=2, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=WINDOW, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}})),
    "phi3": ("Phi3Config", dict(num_hidden_layers=2, sliding_window=WINDOW, tie_word_embeddings=False)),
}


def build(name: str, directory: Path, vocab_size: int, tokenizer, seed: int = 0, **overrides) -> Path:
    """MODELS[name] (its settings updated by `overrides`) with random weights, saved with `tokenizer`."""
    import transformers

    config_class, settings = MODELS[name]
    config = getattr(transformers, config_class)(vocab_size=vocab_size, **{**SHAPE, **settings, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    model.save_pretrained(str(directory))
    tokenizer.hf.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module", params=list(MODELS))
def arch(request, tmp_path_factory, real_tokenizer):
    """(name, model directory, the transformers model) of each architecture."""
    from transformers import AutoModelForCausalLM

    path = build(request.param, tmp_path_factory.mktemp(request.param), len(real_tokenizer.hf), real_tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return request.param, str(path), hf


def our_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """An engine's model's last-row logits for a prompt."""
    return model_logits(llm.engine.runner.model, token_ids)


def our_model_logits(weights, token_ids: list[int]) -> torch.Tensor:
    """The last-row logits of the fp32 model built from loaded weights (loader.LoadedWeights)."""
    model_class = ARCHITECTURES[weights.args.architecture].model_class
    return model_logits(model_class.from_weights(weights, torch.float32, torch.device("cpu")), token_ids)


def model_logits(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """A model's last-row logits [vocab] for a prompt, computed in one forward over a scratch pool."""
    args = model.args
    num_blocks = -(-len(token_ids) // block_size)
    kv = torch.zeros(args.num_layers, 2, num_blocks, block_size, args.num_kv_heads, args.head_dim)
    meta = AttentionMetadata.build([0], [len(token_ids)], [list(range(num_blocks))], block_size, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model.hidden_states(torch.tensor(token_ids), torch.arange(len(token_ids)),
                                     ForwardKV.uniform(kv, meta), torch.tensor([len(token_ids) - 1]))
        return model.compute_logits(hidden)[0]


def hf_greedy(hf, token_ids: list[int], num_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([token_ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                          do_sample=False, pad_token_id=0)
    return out[0, len(token_ids):].tolist()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (5, 23, 61, 90)]


def test_last_row_logits_equal_transformers(arch):
    name, path, hf = arch
    llm = tiny_llm(path)
    assert llm.engine.runner.model.args.architecture == {"llama3": "llama", "llama-linear": "llama",
                                                         "mistral": "llama"}.get(name, name)
    for ids in prompts():
        with torch.inference_mode():
            want = hf(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(our_logits(llm, ids), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("sets", [
    {},                                                  # prefix cache on, whole prompts
    {"cache__enabled": "false"},                         # prefix cache off
    {"engine__max_num_batched_tokens": 16},              # chunked prefill: 16-token chunks
], ids=["cache-on", "cache-off", "chunked"])
def test_greedy_tokens_equal_transformers(arch, sets):
    """A batch of mixed lengths, two of them longer than the sliding window, each prompt run twice (the second from
    the prefix cache where it is on)."""
    _, path, hf = arch
    llm = tiny_llm(path, **sets)
    batch = prompts()
    want = [hf_greedy(hf, ids, 12) for ids in batch]
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(batch, greedy(12))] == want


def test_a_cached_prefix_is_reused_under_every_architecture(arch):
    _, path, hf = arch
    llm = tiny_llm(path)
    first = prompts()[3]
    llm.generate(first, greedy(2))
    second = first[:64] + [7, 8, 9, 10]
    out = llm.generate(second, greedy(8))[0]
    assert out.usage.cached_tokens == 64
    assert out.token_ids == hf_greedy(hf, second, 8)


# --- refusals -------------------------------------------------------------------------------------------


def write_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture
def llama_dir(tmp_path, real_tokenizer) -> Path:
    return build("llama3", tmp_path, len(real_tokenizer.hf), real_tokenizer)


def test_an_unknown_architecture_is_refused_by_name(llama_dir):
    write_config(llama_dir, model_type="falcon")
    with pytest.raises(ModelLoadError, match=r"model_type 'falcon' is not supported \(supported: llama, .*phi3"):
        load_model_info(llama_dir)


def test_an_unknown_rope_type_is_refused_by_name(llama_dir):
    write_config(llama_dir, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},
                 rope_scaling=None)
    with pytest.raises(ModelLoadError, match=r"rope type 'yarn' is not supported \(supported: default, linear, llama3"):
        load_weights(llama_dir)


@pytest.fixture
def phi3_dir(tmp_path, real_tokenizer) -> Path:
    return build("phi3", tmp_path, len(real_tokenizer.hf), real_tokenizer)


# Phi-3 128k's and Phi-3.5's LongRoPE, in today's spelling and in the old one transformers reads as longrope ("su").
LONGROPE = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("changes", [
    dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **LONGROPE}),
    dict(rope_parameters=None, rope_scaling={"type": "su", **LONGROPE}),
], ids=["rope_parameters", "rope_scaling-su"])
def test_longrope_is_refused_by_name(phi3_dir, changes):
    write_config(phi3_dir, **changes)
    with pytest.raises(ModelLoadError, match=r"rope type 'longrope' is not supported \(supported: default, linear, "
                                             r"llama3\)"):
        load_model_info(phi3_dir)


@pytest.mark.parametrize("changes", [
    dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
    dict(rope_parameters=None, partial_rotary_factor=0.75),
], ids=["rope_parameters", "top-level"])
def test_a_partial_rotary_factor_is_refused_by_name(phi3_dir, changes):
    write_config(phi3_dir, **changes)
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor = 0.75 is not supported \(only 1.0"):
        load_model_info(phi3_dir)


def test_a_tensor_the_architecture_does_not_read_is_refused(llama_dir):
    from safetensors.torch import load_file, save_file

    file = llama_dir / "model.safetensors"
    tensors = load_file(str(file))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(SHAPE["hidden_size"])
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"o_proj.bias are not part of kvreuse's llama architecture"):
        load_weights(llama_dir)


def test_config_settings_are_part_of_the_fingerprint(llama_dir, tmp_path, real_tokenizer):
    """Two directories holding the same weights but different rope settings compute different K/V: their blocks
    must not meet in a tier."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(llama_dir, other)
    write_config(other, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    a, b = load_model_info(llama_dir), load_model_info(other)
    assert a.args.rope != b.args.rope and a.fingerprint != b.fingerprint


# --- segment reuse ----------------------------------------------------------------------------------------


def test_rerotation_moves_each_layers_keys_with_its_own_rotary(arch):
    """K rotated at positions p, then moved by d, equals K rotated at p + d, in every layer (Gemma 3's local and
    global layers turn at different speeds: one rotary for all would be wrong on half of them)."""
    _, path, _ = arch
    model = tiny_llm(path).engine.runner.model
    x = model.embed(torch.arange(100, 140))                               # [T, hidden]
    at = lambda positions: torch.stack([layer.qkv(x, *model.cos_sin(positions, x.dtype)[layer.kind])[1]
                                        for layer in model.layers])     # [L, T, Hkv, D]
    positions, deltas = torch.arange(40) + 5, torch.tensor([7, -3, 250, 1] * 10)
    with torch.inference_mode():
        torch.testing.assert_close(model.rotate_by(at(positions), deltas), at(positions + deltas),
                                   atol=2e-5, rtol=1e-5)


def test_segment_reuse_at_full_recompute_is_exact(arch):
    """A block run reused off the prefix (moved by 5 positions) and recomputed in full gives transformers' tokens."""
    _, path, hf = arch
    llm = tiny_llm(path, cache__suffix__enabled="true", cache__suffix__recompute_ratio="1.0",
                   cache__suffix__guard_margin="0", engine__num_kv_blocks=512)
    g = torch.Generator().manual_seed(2)
    document = torch.randint(3, 40000, (64,), generator=g).tolist()
    llm.generate([11, 12, 13] + document, greedy(1))
    second = [21, 22, 23, 24, 25, 26, 27, 28] + document + [31, 32]
    out = llm.generate(second, greedy(8))[0]
    assert out.usage.reused_tokens > 0
    assert out.token_ids == hf_greedy(hf, second, 8)


# --- the engine's other paths -------------------------------------------------------------------------------


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_run_every_architecture(arch, quantization):
    """Weight-only quantization replaces the bias-free linears (biases and norms stay as loaded): the logits stay
    close to the unquantized model's."""
    _, path, _ = arch
    ids = prompts()[2]
    exact = our_logits(tiny_llm(path), ids)
    quantized = our_logits(tiny_llm(path, model__quantization=quantization), ids)
    cosine = torch.nn.functional.cosine_similarity(exact, quantized, dim=0)
    assert cosine > 0.9, f"{quantization}: logit cosine {cosine:.3f}"


def test_compiled_decode_equals_eager_on_sliding_window_layers(compiling, tmp_path, real_tokenizer):
    """Gemma 3's decode steps through the compiled graph (local layers windowed inside its attention op) give the
    eager engine's greedy tokens past the window."""
    from .test_decode_graph import compiled_calls, compiled_llm

    path = str(build("gemma3", tmp_path, len(real_tokenizer.hf), real_tokenizer))
    llm = compiled_llm(model__path=path, model__dtype="fp32", engine__num_kv_blocks=256)
    eager = tiny_llm(path, engine__compile="off")
    batch, params = prompts(), greedy(12)
    outputs, calls = compiled_calls(lambda: llm.generate(batch, params))
    assert calls > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager.generate(batch, params)]
